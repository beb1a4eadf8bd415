"""How ``rollout submit`` names jobs, and what it tells the user when a name was taken.

Job ids are idempotency keys: the server runs a job id once and answers a second submit of it
with ``accepted(duplicate=True)``. ``submit`` derives ids from the file (``<stem>-<line>``) so
that re-running a command after a crash resumes instead of running everything twice. The same
rule surprises someone who re-runs a file on purpose (another ``--out``, another day): nothing
runs and nothing is written. ``EarlierRuns`` notices exactly those jobs and says how to fetch
them or run them again (``--fresh`` / ``--job-prefix``).
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollout.entrypoints.cli import CliError
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb

_ID_CHARS = re.compile(r"[A-Za-z0-9._:/-]+")
ID_TAKEN = "JOB_ID_TAKEN"
"""The server's reason for rejecting a job id that another client id submitted first."""
_TERMINAL = {job_pb2.Job.STATE_SUCCEEDED, job_pb2.Job.STATE_FAILED, job_pb2.Job.STATE_CANCELLED}


def file_stem(path: str) -> str:
    """The default id prefix: the file's name without its suffix, in id characters."""
    return re.sub(r"[^A-Za-z0-9._:/-]", "_", Path(path).stem) or "job"


def check_prefix(prefix: str) -> str:
    if not _ID_CHARS.fullmatch(prefix) or len(prefix) > 96:
        raise CliError("INVALID_ARGUMENT", "BAD_FLAG",
                       f"--job-prefix must be 1-96 letters, digits or ._:/- (job ids are at "
                       f"most 128 characters), got {prefix!r}")
    return prefix


def fresh_prefix(path: str) -> str:
    """``<stem>-<UTC time>-<random>``: readable, sorted by time, and unique even for two
    submits of one file in the same second."""
    return f"{file_stem(path)}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-" \
           f"{secrets.token_hex(2)}"


def id_rule(path: str | None, prefix: str | None) -> str:
    """How this run's ids were made, as the user should read it."""
    if prefix:
        return f"{prefix}-<line>"
    if path:
        return f"<file-stem>-<line>, here {file_stem(path)}-<line>"
    return "as submitted"


@dataclass
class EarlierRuns:
    """Jobs that were already known under their ids when this run submitted them."""

    finished: list[str] = field(default_factory=list)
    """Already finished when re-submitted: they did not run again."""
    running: list[str] = field(default_factory=list)
    """Already queued or running; ours (a resumed run) if they finish in this session."""
    taken: list[str] = field(default_factory=list)
    """Refused because another client id (another ``--out``) submitted them first."""
    finished_here: set[str] = field(default_factory=set)
    written: set[str] = field(default_factory=set)

    def accepted(self, job_id: str, accepted: pb.JobAccepted) -> None:
        if accepted.duplicate:
            (self.finished if accepted.state in _TERMINAL else self.running).append(job_id)

    def taken_by_another(self, job_id: str) -> None:
        self.taken.append(job_id)

    def job_finished(self, job_id: str) -> None:
        self.finished_here.add(job_id)

    def trajectory_written(self, job_id: str) -> None:
        self.written.add(job_id)

    def report(self, total: int, out: str, rule: str) -> list[str]:
        """Plain lines for the user; none when every job ran in this submit."""
        elsewhere = self.taken + [j for j in self.running if j not in self.finished_here]
        earlier = self.finished + elsewhere
        if not earlier:
            return []
        lines = [f"{len(earlier)} of {total} jobs already ran under the same ids before this "
                 f"submit, so they did not run again (job ids are {rule}; e.g. {earlier[0]})."]
        if self.finished:
            now = sum(j in self.written for j in self.finished)
            parts = []
            if now:
                parts.append(f"{now} written to {out} now (the earlier run had not saved them)")
            if len(self.finished) - now:
                parts.append(f"{len(self.finished) - now} delivered before, to the --out of the "
                             "run that submitted them")
            lines.append(f"  {len(self.finished)} had finished: " + "; ".join(parts) + ".")
        if elsewhere:
            lines.append(f"  {len(elsewhere)} belong to another submit (another --out or "
                         "--client-id): their trajectories went, or will go, to its --out.")
        lines.append(f"  see one:         rollout jobs get {earlier[0]} --trajectory")
        lines.append("  run them again:  add --fresh (new ids), or --job-prefix PREFIX")
        return lines
