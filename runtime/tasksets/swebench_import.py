"""Turn SWE-bench instances plus local clones of their repositories into a ready swe task file.

    rollout tasks import-swebench INSTANCES --repos DIR --out FILE
        [--specs SPECS.json] [--no-validate]

``INSTANCES`` is a SWE-bench export (a JSON list or JSONL; ``FAIL_TO_PASS``/``PASS_TO_PASS``
as lists or JSON strings). ``DIR`` holds one git clone per repository, found as
``DIR/owner__name``, ``DIR/owner/name`` or ``DIR/name`` (a clone, a bundle ``.bundle`` or a
``.tar[.gz]`` archive of a clone). ``--specs`` gives the harness's per-repository, per-version
environment specs (``{"owner/name": {"0.3": {"python": ..., "install": ..., "pip_packages":
..., "pre_install": ..., "test_cmd": ...}}}``; keys the harness has and we do not, such as
``packages`` or ``eval_commands``, are reported and left out), unless an instance carries
its own ``spec``.

Every instance is validated through the real swe handler, in sandboxes, as a job would be:
the test patch must apply at ``base_commit``; with no change every FAIL_TO_PASS test must fail
and every PASS_TO_PASS test pass; with the gold ``patch`` all must pass. Instances that fail
any check are left out of the output and reported with the reason.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.runtime.handler import HandlerError, JobContext
from rollout.runtime.types import InvalidArgument, JobSpec, Limits

SPEC_FIELDS = ("python", "pre_install", "install", "pip_packages", "test_cmd")


@dataclass
class ImportReport:
    accepted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    """instance_id -> why it was left out."""
    notes: dict[str, str] = field(default_factory=dict)
    """instance_id -> what was dropped or changed on the way (spec keys we do not run)."""


def read_instances(path: Path) -> list[dict[str, Any]]:
    text = path.read_text()
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: expected JSON objects (SWE-bench instances)")
    return rows


def find_repo(repos: Path, repo: str) -> Path | None:
    owner, _, name = repo.partition("/")
    for stem in (f"{owner}__{name}", f"{owner}/{name}", name):
        for suffix in ("", ".git", ".bundle", ".tar", ".tar.gz", ".tgz"):
            candidate = repos / f"{stem}{suffix}"
            if candidate.exists():
                return candidate.resolve()
    return None


def to_task(instance: Mapping[str, Any], repos: Path,
            specs: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The swe task of one instance, and a note on what was dropped ("" for nothing)."""
    task = {k: instance[k] for k in ("instance_id", "repo", "base_commit", "problem_statement",
                                     "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
            if k in instance}
    for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        if isinstance(task.get(name), str):
            task[name] = json.loads(task[name])
    source = find_repo(repos, str(instance.get("repo", "")))
    if source is None:
        raise LookupError(f"no clone of {instance.get('repo')!r} under {repos}")
    task["repo_source"] = str(source)
    task["test_env"] = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    note = ""
    spec = instance.get("spec")
    if spec is None and "version" in instance:
        spec = specs.get(str(instance.get("repo")), {}).get(str(instance["version"]))
    if spec is not None:
        dropped = sorted(set(spec) - set(SPEC_FIELDS))
        if dropped:
            note = f"spec keys not run here: {', '.join(dropped)}"
        spec = {k: spec[k] for k in SPEC_FIELDS if k in spec}
        for name in ("pre_install", "pip_packages"):
            if isinstance(spec.get(name), str):
                spec[name] = [spec[name]]
        if isinstance(spec.get("test_cmd"), list):
            spec["test_cmd"] = spec["test_cmd"][0]
        task["version"] = str(instance.get("version", ""))
        task["spec"] = spec
    return task, note


async def validate(task: Mapping[str, Any], sandbox_factory: Any) -> str:
    """"" when the instance behaves as SWE-bench promises, else why not."""
    from rollout.runtime.envs.swe.handler import SweHandler

    handler = SweHandler()
    try:
        handler.validate_task(task)
    except InvalidArgument as e:
        return f"invalid task: {e}"
    results = []
    for with_gold in (False, True):
        ctx = JobContext(spec=JobSpec(job_id=f"import-{task['instance_id']}-{int(with_gold)}",
                                      environment="swe", task=dict(task),
                                      limits=Limits(init_timeout_s=900.0)),
                         sandbox_factory=sandbox_factory)
        async with ctx.resources:
            try:
                await handler.init(ctx)
                if with_gold:
                    sandbox = ctx.state["env.sandbox"]
                    applied = await sandbox.exec(["git", "apply", "-"],
                                                 stdin=str(task.get("patch", "")).encode(),
                                                 timeout=60)
                    if not applied.ok:
                        return f"the gold patch does not apply: {applied.output[-300:]}"
                results.append(await handler.eval(ctx))
            except HandlerError as e:
                return f"{e.reason}: {str(e)[:300]}"
    before, after = results
    if "error" in before.info:
        return f"{before.info['error']}: {before.info.get('log', '')[-300:]}"
    if before.components["fail_to_pass"] != 0.0:
        return ("FAIL_TO_PASS tests pass without the fix: "
                f"{sorted(set(task['FAIL_TO_PASS']) - set(before.info['failing'].split(',')))}")
    if before.components["pass_to_pass"] != 1.0:
        return f"PASS_TO_PASS tests fail before the fix: {before.info['failing']}"
    if after.value != 1.0:
        return f"the gold patch does not resolve it: failing {after.info.get('failing')}"
    return ""


async def import_instances(instances: Iterable[Mapping[str, Any]], repos: Path,
                           specs: Mapping[str, Any], *, sandbox_factory: Any,
                           check: bool = True) -> tuple[list[dict[str, Any]], ImportReport]:
    report = ImportReport()
    tasks: list[dict[str, Any]] = []
    for instance in instances:
        iid = str(instance.get("instance_id", f"#{len(tasks) + len(report.rejected)}"))
        try:
            task, note = to_task(instance, repos, specs)
        except (LookupError, KeyError, ValueError) as e:
            report.rejected[iid] = str(e)
            continue
        if note:
            report.notes[iid] = note
        why = await validate(task, sandbox_factory) if check else ""
        if why:
            report.rejected[iid] = why
            continue
        report.accepted.append(iid)
        tasks.append(task)
    return tasks, report


def main(argv: list[str]) -> int:
    import argparse
    import sys

    from rollout.runtime.sandbox import SandboxConfig, create_sandbox

    parser = argparse.ArgumentParser(prog="rollout tasks import-swebench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("instances", type=Path, help="SWE-bench JSON or JSONL")
    parser.add_argument("--repos", type=Path, required=True, help="folder of local clones")
    parser.add_argument("--out", type=Path, required=True, help="task file to write (JSONL)")
    parser.add_argument("--specs", type=Path, help="per-repo, per-version environment specs")
    parser.add_argument("--state-dir", type=Path, default=Path(".rollout"))
    parser.add_argument("--no-validate", action="store_true",
                        help="write every instance without running it")
    args = parser.parse_args(argv)
    specs = json.loads(args.specs.read_text()) if args.specs else {}
    factory = functools.partial(create_sandbox, SandboxConfig(state_dir=args.state_dir))
    tasks, report = asyncio.run(import_instances(
        read_instances(args.instances), args.repos.resolve(), specs, sandbox_factory=factory,
        check=not args.no_validate))
    with open(args.out, "w") as f:
        for task in tasks:
            f.write(json.dumps({"environment": "swe", "task": task}) + "\n")
    for iid, why in report.rejected.items():
        sys.stderr.write(f"rejected {iid}: {why}\n")
    for iid, note in report.notes.items():
        sys.stderr.write(f"note {iid}: {note}\n")
    sys.stdout.write(json.dumps({"accepted": len(report.accepted),
                                 "rejected": len(report.rejected), "out": str(args.out)}) + "\n")
    return 0 if report.accepted or not report.rejected else 1
