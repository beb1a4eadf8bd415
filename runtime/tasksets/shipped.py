"""The shipped task sets, and turning any task file into job lines for ``rollout submit``.

Shipped files (``runtime/envs/data/<env>.jsonl``) hold one job line per task, already in the
shape ``rollout submit FILE.jsonl`` reads, so they can be submitted as they are::

    {"environment": "math", "task": {"id": "math-001", "question": "...", "answer": "391"}}

Optional keys of a job line (``job_id``, ``sampling``, ``limits``) are left out: the client picks
job ids, and the server defaults apply. :func:`load_tasks` also accepts files of bare task
objects (one task per line, as in a SWE-bench export); :func:`job_lines` and
``rollout tasks ENV`` turn either kind into complete job lines.

A relative ``repo_source`` of a swe task is resolved against the shipped data dir
(``runtime/envs/data``) at INIT, on the server; users' own tasks give absolute paths.

Two more commands prepare swe tasks on a machine with registry access, ahead of serving::

    rollout tasks prepare FILE          # wheelhouse + environments
    rollout tasks prepare FILE --runtime apptainer   # ... + each task image pulled/built once
    rollout tasks import-swebench INSTANCES --repos DIR --out FILE

Harbor task folders (the ``harbor`` environment) have their own two, in
:mod:`rollout.runtime.tasksets.harbor_import`::

    rollout tasks import-harbor DIR...      # job lines
    rollout tasks check-harbor DIR...       # oracle 1 and no-op 0, per task
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from rollout.runtime.envs.common import DATA_DIR
from rollout.runtime.sandbox.base import ImageSettings

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


BuildWheels = Callable[[str, list[str], Path], None]
"""``build(python, requirements, wheelhouse)``: build wheels of what has none, in a sandbox."""


def fill_wheelhouse(tasks: Iterable[Mapping[str, Any]], wheelhouse: Path, *,
                    build: BuildWheels | None = None) -> list[str]:
    """Make every ``spec.pip_packages`` of the swe tasks installable offline from
    ``wheelhouse`` (plus the shipped one). Nothing a task supplies runs on the host: the
    requirements were checked to be plain specifiers (:mod:`.pip_requirements`), and the host
    downloads binary wheels only (``--only-binary=:all:``, registry access needed then, and only
    then). What has no wheel is handed to ``build``, which builds it in a sandbox; without one,
    it is an error. Returns the packages that were fetched or built."""
    from rollout.runtime.envs.swe.taskenv import SHIPPED_WHEELHOUSE, EnvSpec

    wheelhouse.mkdir(parents=True, exist_ok=True)
    fetched: list[str] = []
    by_python: dict[tuple[str, str], set[str]] = {}
    for task in tasks:
        spec = EnvSpec.of(task)
        if spec is not None and spec.pip_packages:
            version = subprocess.run([spec.python, "-c", "import sys; print('%d.%d' % "
                                      "sys.version_info[:2])"], capture_output=True, text=True,
                                     check=True).stdout.strip()
            by_python.setdefault((version, spec.python), set()).update(spec.pip_packages)
    links = ["--find-links", str(SHIPPED_WHEELHOUSE), "--find-links", str(wheelhouse)]
    for (version, python), packages in sorted(by_python.items()):
        pins = sorted(packages)
        if _download(version, links, pins, None):
            continue
        if _download(version, links, pins, wheelhouse):
            fetched += pins
            continue
        no_wheel = [p for p in pins if not _download(version, links, [p], wheelhouse)]
        if build is None:
            raise RuntimeError(f"no binary wheel of {no_wheel} for Python {version}, and "
                               "nothing is built on the host")
        build(python, no_wheel, wheelhouse)
        if not _download(version, links, pins, wheelhouse):
            raise RuntimeError(f"pip download of {pins} for Python {version} failed after "
                               f"building {no_wheel} in a sandbox")
        fetched += pins
    return fetched


def _download(version: str, links: list[str], pins: list[str], dest: Path | None) -> bool:
    """``pip download`` of binary wheels only; ``dest`` None: offline, into a scratch dir
    (does the wheelhouse hold them all?). Run in an empty directory, the requirements after
    ``--``: nothing can be read as a local path or an option."""
    with tempfile.TemporaryDirectory(prefix="rollout-pip-") as scratch:
        argv = [sys.executable, "-m", "pip", "download", "-q", *links, "--python-version",
                version, "--only-binary=:all:", "--disable-pip-version-check",
                *(("--no-index", "-d", scratch) if dest is None else ("-d", str(dest))),
                "--", *pins]
        return subprocess.run(argv, capture_output=True, text=True, cwd=scratch).returncode == 0


async def prepare(path: Path, wheelhouse: Path, state_dir: Path, *, runtime: str = "bwrap",
                  server_image: str | None = None,
                  images: ImageSettings | None = None) -> list[dict[str, Any]]:
    """``prepare FILE``: fill the wheelhouse, then build every environment the file's swe
    tasks need (one per repository, version and spec), so INIT finds them ready. Task images
    that the image cache serves (``docker://``, ``oci:``, ... on bwrap; see
    docs/images.md) are fetched and unpacked into it first, with progress bars on stderr;
    under ``runtime="apptainer"`` the other task images are pulled or built once into the SIF
    cache instead (venvs of tasks without an image build in ``server_image``); under bwrap any
    other task image is refused, as the server would refuse it. The images of image instances
    (the repository at the image's ``/testbed``: SWE-bench, SWE-Gym, SWE-rebench, SWE-smith
    rows; :mod:`rollout.runtime.envs.swe.images`) are fetched the same way; they have no
    environment to build."""
    import functools
    import os
    import time

    from rollout.runtime.envs.swe import images as swe_images
    from rollout.runtime.envs.swe.handler import check_out, read_source, resolve_source
    from rollout.runtime.envs.swe.repo_cut import cut_at_base
    from rollout.runtime.envs.swe.taskenv import (
        EnvSpec,
        build_wheels,
        ensure_env,
        image_cache_dir,
        set_sandbox_runtime,
    )
    from rollout.runtime.sandbox import SandboxConfig, create_sandbox
    from rollout.runtime.sandbox.apptainer import ensure_image
    from rollout.runtime.sandbox.images.prepare import prepare_images

    def uses_image_cache(image: str, config: SandboxConfig) -> bool:
        from rollout.runtime.sandbox.apptainer import uses_image_cache as apptainer_uses
        from rollout.runtime.sandbox.images import is_image_ref
        return is_image_ref(image) if config.runtime == "bwrap" else apptainer_uses(
            image, config)

    previous = set_sandbox_runtime(runtime)
    try:
        # Image instances carry their repository; the other tasks' environments are built here.
        instances: list[dict[str, Any]] = []
        tasks: list[dict[str, Any]] = []
        for task in read_task_file(path, "swe"):
            (instances if swe_images.is_image_instance(task) else tasks).append(task)
        for task in instances:  # a refused row stops before any work
            swe_images.validate(task)
        specs = [EnvSpec.of(task) for task in tasks]  # a refused image stops before any work
    finally:
        set_sandbox_runtime(previous)
    instance_images = [(task_key(task), swe_images.image_of(task)) for task in instances]
    settings = images or ImageSettings()
    config = (SandboxConfig(runtime="apptainer", state_dir=state_dir, image=server_image,
                            images=settings)
              if runtime == "apptainer" else SandboxConfig(state_dir=state_dir, images=settings))
    factory = functools.partial(create_sandbox, config)
    loop = asyncio.get_running_loop()

    def build(python: str, requirements: list[str], house: Path) -> None:
        asyncio.run_coroutine_threadsafe(
            build_wheels(python, requirements, house, factory), loop).result()

    fetched = await asyncio.to_thread(fill_wheelhouse, tasks, wheelhouse, build=build)
    os.environ["ROLLOUT_WHEELHOUSE"] = str(wheelhouse)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    cached = [spec.image for spec in specs if spec is not None and spec.image
              and uses_image_cache(spec.image, config)]
    cached += [image for _, image in instance_images
               if uses_image_cache(image, config) and image not in cached]
    if cached:
        done_images = await asyncio.to_thread(prepare_images, cached, images)
        rows += [{"task": "", **p.row()} for p in done_images]
        for p in done_images:
            if p.error is not None:  # the server would fail these tasks' jobs in INIT
                raise p.error
        seen.update(cached)
    for key, image in instance_images:  # (apptainer: the images it pulls itself)
        if image not in seen:
            seen.add(image)
            done = await asyncio.to_thread(ensure_image, image, image_cache_dir())
            rows.append({"task": key, "image": done.ref, "action": done.action,
                         "seconds": done.seconds, "path": done.path})
    for task, spec in zip(tasks, specs, strict=True):
        if spec is not None and spec.image:
            if spec.image not in seen:
                seen.add(spec.image)
                done = await asyncio.to_thread(ensure_image, spec.image, image_cache_dir())
                rows.append({"task": task_key(task), "image": done.ref, "action": done.action,
                             "seconds": done.seconds, "path": done.path})
            continue
        if spec is None or spec.key in seen:
            continue
        seen.add(spec.key)
        kind, data = await cut_at_base(
            *await asyncio.to_thread(read_source, resolve_source(task["repo_source"])),
            task["base_commit"], factory)

        async def checkout(sandbox: Any, task: Mapping[str, Any] = task, kind: str = kind,
                           data: bytes = data) -> None:
            await check_out(sandbox, task, kind, data, 300.0)

        started = time.monotonic()
        env_dir, built = await ensure_env(spec, factory, checkout)
        rows.append({"task": task_key(task), "env": spec.key, "built": built,
                     "seconds": round(time.monotonic() - started, 2), "path": str(env_dir),
                     **({"lock": str(env_dir / "lock.txt")} if spec.pip_packages else {})})
    rows.append({"fetched": fetched})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["prepare"]:
        return _prepare_main(argv[1:])
    if argv[:1] in (["import-harbor"], ["check-harbor"]):
        from rollout.runtime.tasksets.harbor_import import main as harbor_main

        return harbor_main(argv)
    if argv[:1] == ["import-swebench"]:
        from rollout.runtime.tasksets.swebench_import import main as import_main

        return import_main(argv[1:])
    parser = argparse.ArgumentParser(prog="rollout tasks",
                                     description="Print job lines for `rollout submit`.")
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


def _prepare_main(argv: list[str]) -> int:
    from rollout.runtime.envs.swe.taskenv import cache_dir, image_cache_dir, user_wheelhouses
    from rollout.runtime.handler import HandlerError
    from rollout.runtime.sandbox.base import SandboxError
    from rollout.runtime.types import InvalidArgument

    parser = argparse.ArgumentParser(
        prog="rollout tasks prepare",
        description="Fill the wheelhouse and build the environments of a swe task file ahead "
                    "of time (needs registry access only for packages the wheelhouse lacks).")
    parser.add_argument("file", type=Path, help="a task file (JSONL of tasks or job lines)")
    parser.add_argument("--wheelhouse", type=Path, default=None,
                        help="where downloaded wheels go (default: $ROLLOUT_WHEELHOUSE or "
                             "~/.cache/rollout/wheelhouse)")
    parser.add_argument("--state-dir", type=Path, default=Path(".rollout"),
                        help="state dir for the build sandboxes")
    parser.add_argument("--runtime", choices=("bwrap", "apptainer"), default="bwrap",
                        help="the sandbox runtime the server will run: with apptainer, each "
                             "task image (spec.image) is pulled or built once into "
                             "$ROLLOUT_SIF_CACHE (default ~/.cache/rollout/sif)")
    parser.add_argument("--image-cache", default="",
                        help="the image cache task images (docker://, oci:, ...) go into "
                             "(default: $ROLLOUT_IMAGE_CACHE or ~/.cache/rollout/images; the "
                             "server's sandbox.image_cache must name the same)")
    parser.add_argument("--registries-conf", default="",
                        help="a registries.conf for the image fetches (default: "
                             "$CONTAINERS_REGISTRIES_CONF, else the system's)")
    parser.add_argument("--sandbox-image", default=None,
                        help="apptainer: the server's image, for building the venvs of tasks "
                             "without an image of their own")
    args = parser.parse_args(argv)
    wheelhouse = args.wheelhouse or user_wheelhouses()[0]
    try:
        images = ImageSettings(cache_dir=args.image_cache,
                               registries_conf=args.registries_conf)
        rows = asyncio.run(prepare(args.file, wheelhouse, args.state_dir, runtime=args.runtime,
                                   server_image=args.sandbox_image, images=images))
    except (InvalidArgument, SandboxError, HandlerError, RuntimeError) as e:
        sys.stderr.write(f"rollout tasks prepare: {e}\n")
        return 2
    for row in rows:
        sys.stdout.write(json.dumps(row) + "\n")
    summary = {"env_cache": str(cache_dir()), "wheelhouse": str(wheelhouse)}
    summary["images"] = str(images.resolved_cache_dir())
    if args.runtime == "apptainer":
        summary["image_cache"] = str(image_cache_dir())
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
