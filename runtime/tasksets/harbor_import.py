"""Harbor task folders as job lines, and Harbor's oracle check.

    rollout tasks import-harbor DIR... [--agent model|oracle|noop] [--samples N]
                                       [--job-id-prefix P] [--out FILE]
                                       [--prepare [--image-cache DIR] [--registries-conf F]]
    rollout tasks check-harbor DIR... [--state-dir DIR] [--image-cache DIR]
                                      [--registries-conf FILE]

``DIR`` is one task folder (it holds ``task.toml``) or a data set of them (every folder below
that holds one). ``import-harbor`` prints one ``rollout submit`` line per task and sample: the
``harbor`` environment's task (the folder's absolute path and its digest) and the limits its
``task.toml`` sets (the agent's timeout as the RUN stage's, the verifier's and the build's
with room for the set-up around them). A folder that is not a usable task stops the import
with the file and key to fix; keys Harbor has and this server ignores are listed on stderr.
With ``--prepare`` every task's image is pulled (``docker_image``) or built
(``environment/Dockerfile``) into the image cache first, with a progress bar each, so no job's
INIT waits for it; a task whose image fails stops the import, naming it.

``check-harbor`` runs each task twice through the real ``harbor`` handler, in sandboxes on this
machine, as Harbor's own oracle check does: the ``oracle`` agent (``solution/solve.sh``; a
multi-step task's ``steps/NAME/solution/solve.sh`` in turn) must earn 1 and the ``noop`` agent
0. It prints one JSON line per task and exits 1 when any task
fails either run, listing those tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.runtime.envs.harbor import taskdir
from rollout.runtime.envs.harbor.taskdir import HarborTask, TaskFolderError

SETUP_MARGIN_S = 120.0
"""Time the INIT and EVAL stages get beyond the task's build and verifier timeouts (the
sandbox, copying the tests)."""


def job_line(harbor: HarborTask, *, agent: str = "model", job_id: str | None = None,
             digest: str | None = None) -> dict[str, Any]:
    """One ``rollout submit`` line for a task folder."""
    task: dict[str, Any] = {"task_dir": str(harbor.path), "name": harbor.name}
    if agent != "model":
        task["agent"] = agent
    if digest:
        task["digest"] = digest
    line: dict[str, Any] = {"environment": "harbor", "task": task,
                            "limits": limits_of(harbor)}
    if job_id is not None:
        line["job_id"] = job_id
    return line


def limits_of(harbor: HarborTask) -> dict[str, str]:
    """The job limits a task's ``task.toml`` asks for, as a job line spells them (the
    ``Limits`` message in JSON: durations as ``"420s"``). INIT gets the task's
    ``build_timeout_sec`` whether the image is built or prebuilt: fetching a prebuilt image
    (an SWE-bench one is gigabytes) is the environment's set-up too, and a job that finds it
    missing from the cache does it in INIT."""
    # INIT builds (or pulls) a separate verifier's image too.
    init = harbor.build_timeout_s + SETUP_MARGIN_S + sum(
        env.build_timeout_s for env in harbor.verifier_environments)
    if harbor.steps:
        # RUN holds every step's agent and every step's verifier but the last (EVAL's), with
        # room for each step's set-up (workdir copy, setup.sh, healthcheck).
        steps = harbor.steps
        run = sum(s.agent_timeout_s + SETUP_MARGIN_S + _healthcheck_s(s) for s in steps) + sum(
            s.verifier_timeout_s + (SETUP_MARGIN_S if s.separate else 0) for s in steps[:-1])
        return {"initTimeout": f"{init:g}s", "runTimeout": f"{run + 5.0:g}s",
                "evalTimeout": f"{steps[-1].verifier_timeout_s + SETUP_MARGIN_S:g}s"}
    return {"initTimeout": f"{init:g}s",
            "runTimeout": f"{harbor.agent_timeout_s + 5.0:g}s",
            "evalTimeout": f"{harbor.verifier_timeout_s + SETUP_MARGIN_S:g}s"}


def _healthcheck_s(step: taskdir.HarborStep) -> float:
    """The longest a step's healthcheck can take before it fails."""
    check = step.healthcheck
    if check is None:
        return 0.0
    return check.start_period_s + check.retries * (check.timeout_s + check.interval_s)


def limits_value(line: Mapping[str, Any]) -> Any:
    """A job line's limits as the runtime's ``Limits``."""
    from rollout.runtime.types import Limits

    given = line.get("limits", {})

    def seconds(key: str, default: float) -> float:
        return float(str(given[key]).rstrip("s")) if key in given else default

    base = Limits()
    return Limits(init_timeout_s=seconds("initTimeout", base.init_timeout_s),
                  run_timeout_s=seconds("runTimeout", base.run_timeout_s),
                  eval_timeout_s=seconds("evalTimeout", base.eval_timeout_s))


def import_lines(paths: Iterable[Path], *, agent: str = "model", samples: int = 1,
                 job_id_prefix: str = "") -> tuple[list[dict[str, Any]], list[str]]:
    """Job lines for every task below ``paths``, and notes (ignored keys) to show."""
    lines: list[dict[str, Any]] = []
    notes: list[str] = []
    for folder in taskdir.find_tasks(list(paths)):
        harbor = taskdir.load(folder)
        if harbor.unknown_keys:
            notes.append(f"{folder}: task.toml keys this server ignores: "
                         f"{', '.join(harbor.unknown_keys)}")
        if harbor.allow_internet:
            notes.append(f"{folder}: allow_internet is true, but the agent runs without "
                         "network (its tests/test.sh reaches the server's "
                         "sandbox.verifier_hosts only)")
        digest = taskdir.digest(folder)
        slug = harbor.name.replace("/", "__")
        for k in range(samples):
            job_id = f"{job_id_prefix}{slug}-{k}" if job_id_prefix else None
            lines.append(job_line(harbor, agent=agent, job_id=job_id, digest=digest))
    return lines, notes


@dataclass(frozen=True)
class CheckResult:
    """One task's oracle check: the oracle's reward and the no-op's, and why a run failed."""

    task: str
    path: str
    oracle: float | None
    noop: float | None
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "path": self.path, "oracle": self.oracle, "noop": self.noop,
                "ok": self.ok, "problems": list(self.problems)}


async def run_once(line: Mapping[str, Any], sandbox_factory: Any,
                   job_id: str) -> tuple[float | None, str]:
    """Run one job line through the harbor handler in-process: (reward, '' or why it
    failed)."""
    from rollout.runtime.envs.harbor.handler import HarborHandler
    from rollout.runtime.handler import HandlerError, JobContext
    from rollout.runtime.sandbox.base import SandboxError
    from rollout.runtime.types import InvalidArgument, JobSpec

    handler = HarborHandler()
    limits = limits_value(line)
    ctx = JobContext(spec=JobSpec(job_id=job_id, environment="harbor", task=dict(line["task"]),
                                  limits=limits), sandbox_factory=sandbox_factory)
    async with ctx.resources:
        try:
            await asyncio.wait_for(handler.init(ctx), limits.init_timeout_s)
            ctx.outcome = await asyncio.wait_for(handler.run(ctx), limits.run_timeout_s)
            reward = await asyncio.wait_for(handler.eval(ctx), limits.eval_timeout_s)
        except (HandlerError, SandboxError, InvalidArgument) as e:
            return None, f"{getattr(e, 'reason', type(e).__name__)}: {str(e)[:500]}"
        except TimeoutError:
            return None, "a stage ran past its time limit"
        finally:
            await handler.cleanup(ctx)
    why = reward.info.get("error", "")
    if reward.info.get("network_refused"):
        why = "; ".join(filter(None, (
            why, f"the verifier's network refused {reward.info['network_refused']} (to let "
                 "tests/test.sh reach them, list them in the server's sandbox.verifier_hosts; "
                 "here: --verifier-host)")))
    if reward.info.get("network_failed"):
        why = "; ".join(filter(None, (
            why, f"the verifier's network could not reach {reward.info['network_failed']}")))
    if ctx.outcome is not None and ctx.outcome.metadata.get("oracle_exit", "0") != "0":
        why = (f"solve.sh exited {ctx.outcome.metadata['oracle_exit']}: "
               f"{ctx.outcome.metadata.get('oracle_log', '')[-300:]}")
    return reward.value, why


async def check(paths: Iterable[Path], sandbox_factory: Any) -> list[CheckResult]:
    """Harbor's oracle check of every task below ``paths``: oracle 1, no-op 0."""
    results = []
    for folder in taskdir.find_tasks(list(paths)):
        try:
            harbor = taskdir.load(folder)
        except TaskFolderError as e:
            results.append(CheckResult(folder.name, str(folder), None, None, (str(e),)))
            continue
        problems: list[str] = []
        rewards: dict[str, float | None] = {}
        for agent, want in (("oracle", 1.0), ("noop", 0.0)):
            if agent == "oracle" and not harbor.has_solution:
                problems.append("no solution/solve.sh for the oracle")
                rewards[agent] = None
                continue
            value, why = await run_once(job_line(harbor, agent=agent), sandbox_factory,
                                        f"check-{folder.name}-{agent}")
            rewards[agent] = value
            if value != want:
                problems.append(f"{agent} earned {value} (expected {want:g})"
                                + (f": {why}" if why else ""))
        results.append(CheckResult(harbor.name, str(folder), rewards["oracle"],
                                   rewards["noop"], tuple(problems)))
    return results


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    if command == "import-harbor":
        return _import_main(rest)
    return _check_main(rest)


def _import_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rollout tasks import-harbor",
                                     description="Job lines for Harbor task folders.")
    parser.add_argument("dirs", nargs="+", type=Path, help="task folders or data sets of them")
    parser.add_argument("--agent", choices=("model", "oracle", "noop"), default="model",
                        help="who solves the task: the model (default), the task's "
                             "solution/solve.sh, or nobody")
    parser.add_argument("--samples", type=int, default=1, help="jobs per task")
    parser.add_argument("--job-id-prefix", default="", help="derive stable job ids")
    parser.add_argument("--out", type=Path, help="write the lines here instead of stdout")
    parser.add_argument("--prepare", action="store_true",
                        help="pull or build every task's image into the image cache now")
    parser.add_argument("--image-cache", default="",
                        help="with --prepare: the image cache (default $ROLLOUT_IMAGE_CACHE or "
                             "~/.cache/rollout/images; the server's sandbox.image_cache must "
                             "name the same)")
    parser.add_argument("--registries-conf", default="",
                        help="with --prepare: a registries.conf for the fetches and builds")
    args = parser.parse_args(argv)
    try:
        lines, notes = import_lines(args.dirs, agent=args.agent, samples=args.samples,
                                    job_id_prefix=args.job_id_prefix)
        if args.prepare:
            failed = prepare_images(lines, args.image_cache, args.registries_conf)
            if failed:
                sys.stderr.write("".join(f"rollout tasks import-harbor: {why}\n"
                                         for why in failed))
                return 2
    except (TaskFolderError, OSError) as e:
        sys.stderr.write(f"rollout tasks import-harbor: {e}\n")
        return 2
    for note in notes:
        sys.stderr.write(f"note: {note}\n")
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if args.out:
        args.out.write_text(text)
        sys.stderr.write(f"{len(lines)} job lines written to {args.out}\n")
    else:
        sys.stdout.write(text)
    return 0


def prepare_images(lines: list[dict[str, Any]], cache_dir: str = "",
                   registries_conf: str = "") -> list[str]:
    """Pull or build the images of the tasks of ``lines`` into the image cache (each once);
    returns why each failed, naming the task."""
    from rollout.runtime.envs.harbor.handler import image_source, verifier_source
    from rollout.runtime.sandbox.base import ImageSettings
    from rollout.runtime.sandbox.images.prepare import prepare_images as prepare

    sources: dict[tuple[Path, int], tuple[str, Any]] = {}
    for line in lines:
        harbor = taskdir.load(Path(line["task"]["task_dir"]))
        sources.setdefault((harbor.path, 0), (harbor.name, image_source(harbor)))
        for k, env in enumerate(harbor.verifier_environments, 1):
            sources.setdefault((harbor.path, k), (harbor.name, verifier_source(harbor, env)))
    settings = ImageSettings(cache_dir=cache_dir, registries_conf=registries_conf)
    done = prepare([source for _, source in sources.values()], settings)
    names = {str(getattr(source, "name", source)): name for name, source in sources.values()}
    return [f"{names.get(p.source, p.source)}: {p.error}" for p in done if p.error is not None]


def _check_main(argv: list[str]) -> int:
    from rollout.runtime.sandbox import SandboxConfig, create_sandbox
    from rollout.runtime.sandbox.base import ImageSettings
    from rollout.runtime.sandbox.images.egress import check_entries

    parser = argparse.ArgumentParser(
        prog="rollout tasks check-harbor",
        description="Run each Harbor task's solution/solve.sh (expects reward 1) and a no-op "
                    "(expects 0) in sandboxes on this machine; list the tasks failing either.")
    parser.add_argument("dirs", nargs="+", type=Path, help="task folders or data sets of them")
    parser.add_argument("--state-dir", type=Path, default=Path(".rollout"),
                        help="state dir for the sandboxes")
    parser.add_argument("--image-cache", default="",
                        help="the image cache (default $ROLLOUT_IMAGE_CACHE or "
                             "~/.cache/rollout/images)")
    parser.add_argument("--registries-conf", default="",
                        help="a registries.conf for the fetches and builds")
    parser.add_argument("--verifier-host", action="append", default=[], metavar="HOST",
                        help="a host tests/test.sh may reach over HTTP(S), as the server's "
                             "sandbox.verifier_hosts lists them (host, host:port, *.domain; "
                             "repeat it)")
    args = parser.parse_args(argv)
    try:
        hosts = check_entries(args.verifier_host)
    except ValueError as e:
        parser.error(f"--verifier-host: {e}")
    images = ImageSettings(cache_dir=args.image_cache, registries_conf=args.registries_conf)
    factory = functools.partial(create_sandbox, SandboxConfig(state_dir=args.state_dir,
                                                              images=images,
                                                              verifier_hosts=hosts))
    try:
        results = asyncio.run(check(args.dirs, factory))
    except (TaskFolderError, OSError) as e:
        sys.stderr.write(f"rollout tasks check-harbor: {e}\n")
        return 2
    for result in results:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
    failed = [r for r in results if not r.ok]
    for result in failed:
        sys.stderr.write(f"FAILED {result.task} ({result.path}): "
                         f"{'; '.join(result.problems)}\n")
    sys.stderr.write(f"{len(results) - len(failed)} of {len(results)} tasks pass the oracle "
                     "check\n")
    return 1 if failed else 0
