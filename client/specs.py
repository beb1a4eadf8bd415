"""Building ``JobSpec`` messages from plain Python values.

Trainers and the command line mostly hold dicts (JSONL lines, configs); ``job_spec`` turns
them into protos through protobuf's JSON mapping, so the accepted shape is exactly the proto's
JSON form (``"limits": {"run_timeout": "30s"}``, field names in snake_case or camelCase) and a
typo fails here, client-side, with the field named.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

from google.protobuf import json_format

from rollout.v1 import job_pb2

SpecLike: TypeAlias = job_pb2.JobSpec | Mapping[str, Any]


def job_spec(spec: SpecLike | None = None, **fields: Any) -> job_pb2.JobSpec:
    """A ``JobSpec`` from a proto (copied), a dict in the proto's JSON form, or keywords.

    Keywords override the dict: ``job_spec(line, job_id="x")``.
    """
    if isinstance(spec, job_pb2.JobSpec):
        out = job_pb2.JobSpec()
        out.CopyFrom(spec)
        if fields:
            json_format.ParseDict(fields, out)
        return out
    merged = dict(spec or {})
    merged.update(fields)
    try:
        return json_format.ParseDict(merged, job_pb2.JobSpec())
    except json_format.ParseError as exc:
        raise ValueError(f"bad job spec: {exc}") from exc


def job_specs(specs: SpecLike | Iterable[SpecLike]) -> list[job_pb2.JobSpec]:
    if isinstance(specs, job_pb2.JobSpec | Mapping):
        return [job_spec(specs)]
    return [job_spec(s) for s in specs]


def group_specs(template: SpecLike, n: int, group_id: str,
                finish_after: int = 0) -> list[job_pb2.JobSpec]:
    """``n`` samples of one prompt: jobs ``{group_id}/{i}`` sharing one ``GroupSpec``.

    When the template pins a seed, sample ``i`` gets ``seed + i * 1_000_003`` so the samples
    differ (turn k of a job uses seed + k, hence the large stride) yet stay reproducible.
    """
    if n <= 0:
        raise ValueError("a group needs at least one job")
    base = job_spec(template)
    out = []
    for i in range(n):
        spec = copy.deepcopy(base)
        spec.job_id = f"{group_id}/{i}"
        spec.group.CopyFrom(job_pb2.GroupSpec(group_id=group_id, size=n,
                                              finish_after=finish_after))
        if base.HasField("sampling") and base.sampling.HasField("seed"):
            spec.sampling.seed = base.sampling.seed + i * 1_000_003
        out.append(spec)
    return out
