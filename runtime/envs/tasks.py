"""The shipped task sets, and turning any task file into job lines for ``rollout submit``.

Shipped files (``runtime/envs/data/<env>.jsonl``) hold one job line per task, already in the
shape ``rollout submit FILE.jsonl`` reads, so they can be submitted as they are::

    {"environment": "math", "task": {"id": "math-001", "question": "...", "answer": "391"}}

Optional keys of a job line (``job_id``, ``sampling``, ``limits``) are left out: the client picks
job ids, and the server defaults apply. :func:`load_tasks` also accepts files of bare task
objects (one task per line, as in a SWE-bench export); :func:`job_lines` and
``python -m runtime.envs.tasks ENV`` turn either kind into complete job lines.

A relative ``repo_source`` of a swe task is resolved against the shipped data dir
(``runtime/envs/data``) at INIT, on the server; users' own tasks give absolute paths.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollout.runtime.envs.common import DATA_DIR

ENVIRONMENTS = ("math", "code", "swe")


def task_file(env: str) -> Path:
    if env not in ENVIRONMENTS:
        raise ValueError(f"no shipped task set for {env!r}; shipped: {', '.join(ENVIRONMENTS)}")
    return DATA_DIR / f"{env}.jsonl"


def read_task_file(path: str | Path, env: str | None = None) -> list[dict[str, Any]]:
    """Tasks of a JSONL file of job lines or of bare tasks; with ``env``, only that env's."""
    tasks: list[dict[str, Any]] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object")
        if "task" in row and "environment" in row:
            if env is not None and row["environment"] != env:
                continue
            row = row["task"]
        tasks.append(row)
    return tasks


def load_tasks(env: str) -> list[dict[str, Any]]:
    """The shipped tasks of ``env`` (``math``, ``code`` or ``swe``), as task payloads."""
    return read_task_file(task_file(env), env)


def job_line(env: str, task: Mapping[str, Any], *, job_id: str | None = None,
             sampling: Mapping[str, Any] | None = None,
             limits: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One ``rollout submit`` line for a task."""
    line: dict[str, Any] = {"environment": env, "task": dict(task)}
    if job_id is not None:
        line["job_id"] = job_id
    if sampling:
        line["sampling"] = dict(sampling)
    if limits:
        line["limits"] = dict(limits)
    return line


def task_key(task: Mapping[str, Any]) -> str:
    """The task's own id (``id``, or ``instance_id`` for SWE-bench instances), or ``""``."""
    return str(task.get("id") or task.get("instance_id") or "")


def job_lines(env: str, tasks: Iterable[Mapping[str, Any]], *, samples: int = 1,
              job_id_prefix: str = "", **options: Any) -> list[dict[str, Any]]:
    """Job lines for ``samples`` rollouts of each task; ids ``<prefix><task id>-<k>`` when a
    prefix is given (so resubmitting the file is idempotent), else chosen by the client."""
    lines = []
    for i, task in enumerate(tasks):
        for k in range(samples):
            job_id = None
            if job_id_prefix:
                job_id = f"{job_id_prefix}{task_key(task) or i}-{k}"
            lines.append(job_line(env, task, job_id=job_id, **options))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print job lines for `rollout submit`.")
    parser.add_argument("env", choices=ENVIRONMENTS)
    parser.add_argument("--file", type=Path, help="a task file (default: the shipped set)")
    parser.add_argument("--samples", type=int, default=1, help="rollouts per task")
    parser.add_argument("--job-id-prefix", default="", help="derive stable job ids")
    args = parser.parse_args(argv)
    tasks = read_task_file(args.file, args.env) if args.file else load_tasks(args.env)
    for line in job_lines(args.env, tasks, samples=args.samples,
                          job_id_prefix=args.job_id_prefix):
        sys.stdout.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
