"""swe tasks with their own Apptainer image (``spec.image``), against a TEST-ONLY stand-in of
the ``singularity`` CLI.

No apptainer/singularity binary exists on our machines: ``fake_singularity/singularity``
records every invocation and runs ``exec`` commands on the host, isolating nothing, and the
wrapper below adds ``pull`` / ``build`` (recorded; they write a placeholder file). So these
tests check the command lines we drive the real CLI with, not what a real image does: the job's
sandbox and its grading sandbox start the task's image with every extra bind read-only; a task
without an image gets its venv through ``--bind DIR:/.rollout-env:ro``; a bwrap server refuses a
task image; an image path outside the allowed roots is refused; ``prepare`` pulls each distinct
image once.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.common import DATA_DIR, PRIVATE_DIR, set_host_path_roots
from rollout.runtime.envs.swe.handler import SweHandler, named_tests
from rollout.runtime.envs.swe.taskenv import ENV_MOUNT, EnvSpec, set_sandbox_runtime
from rollout.runtime.handler import HandlerError, JobContext
from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.apptainer import cached_sif
from rollout.runtime.sandbox.base import runtime_of
from rollout.runtime.tasksets.shipped import load_tasks, prepare
from rollout.runtime.tasksets.shipped import main as tasks_main
from rollout.runtime.types import InvalidArgument, JobSpec, Limits

pytestmark = pytest.mark.timeout(120)
FAKE = Path(__file__).parent / "fake_singularity" / "singularity"
MDURL = {t["instance_id"]: t for t in load_tasks("swe")}["rollout__mdurl-1"]
_PULL_BUILD = f"""#!/usr/bin/env python3
# pull/build for the test: record, write a placeholder SIF; the rest goes to the shared fake.
import json, os, sys
argv = sys.argv[1:]
if argv[:1] in (["pull"], ["build"]):
    with open(os.environ["FAKE_SINGULARITY_LOG"], "a") as f:
        f.write(json.dumps(argv) + "\\n")
    out = [a for a in argv[1:] if not a.startswith("-")][0]
    with open(out, "w") as f:
        f.write("SIF of " + argv[-1])
    sys.exit(0)
os.execv({str(FAKE)!r}, [{str(FAKE)!r}, *argv])
"""


@dataclass
class Fake:
    root: Path
    """An allowed task path root: local images live here."""
    log: Path
    server_image: Path
    config: SandboxConfig

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [[a for a in json.loads(line) if a != "--quiet"]
                for line in self.log.read_text().splitlines()]

    def starts(self) -> list[list[str]]:
        return [c for c in self.calls() if c[:2] == ["instance", "start"]]

    def factory(self) -> Any:
        return functools.partial(create_sandbox, self.config)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fake]:
    # The stand-in runs sandbox commands on the host, so every grader's private files share
    # the host's /tmp/.rollout-eval: one test at a time on the machine, whichever suite (two
    # suites at once, three clones' at load 15, took each other's checkout source, and one's
    # clean-up below removed it under the other).
    with open(Path(tempfile.gettempdir()) / "rollout-fake-singularity.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _fake(monkeypatch)


def _fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fake]:
    d = Path(tempfile.mkdtemp(prefix="rti", dir="/tmp"))
    (d / "bin").mkdir()
    wrapper = d / "bin" / "singularity"
    wrapper.write_text(_PULL_BUILD)
    wrapper.chmod(0o755)
    allowed = d / "tasks"
    allowed.mkdir()
    server_image = d / "server.sif"
    server_image.write_bytes(b"SIF-server")
    monkeypatch.setenv("PATH", f"{d / 'bin'}:/usr/local/bin:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_SINGULARITY_LOG", str(d / "calls.jsonl"))
    monkeypatch.setenv("FAKE_SINGULARITY_STATE", str(d / "instances"))
    monkeypatch.setenv("ROLLOUT_SIF_CACHE", str(d / "sif-cache"))
    monkeypatch.setenv("ROLLOUT_SWE_ENV_CACHE", str(d / "envs"))
    # The stand-in runs sandbox commands on the host, so the grader's private files land in
    # the host's /tmp: remove them afterwards unless something else had made that folder.
    private_existed = Path(PRIVATE_DIR).exists()
    roots = set_host_path_roots([DATA_DIR, allowed])
    runtime = set_sandbox_runtime(None)
    try:
        yield Fake(allowed, d / "calls.jsonl", server_image,
                   SandboxConfig(runtime="apptainer", image=str(server_image),
                                 state_dir=d / "state"))
    finally:
        set_host_path_roots(roots)
        set_sandbox_runtime(runtime)
        shutil.rmtree(d, ignore_errors=True)
        if not private_existed:
            shutil.rmtree(PRIVATE_DIR, ignore_errors=True)


def with_spec(**spec: Any) -> dict[str, Any]:
    return {**{k: v for k, v in MDURL.items() if k != "spec"}, "spec": spec}


def extra_binds(start: list[str]) -> list[str]:
    """The --bind values of an instance start beyond the sandbox's own three directories."""
    binds = [start[i + 1] for i, a in enumerate(start) if a == "--bind"]
    own = (":/workspace", ":/tmp", ":/.sandbox")
    return [b for b in binds if not b.endswith(own)]


async def init_and_eval(task: dict[str, Any], factory: Any) -> tuple[JobContext, Any]:
    """INIT then EVAL (no RUN: the grader grades the untouched checkout)."""
    handler = SweHandler()
    ctx = JobContext(spec=JobSpec(job_id="img-1", environment="swe", task=task,
                                  limits=Limits(init_timeout_s=120.0, eval_timeout_s=120.0)),
                     sandbox_factory=factory)
    async with ctx.resources:
        handler.validate_task(task)
        await handler.init(ctx)
        reward = await handler.eval(ctx)
        await handler.cleanup(ctx)
    return ctx, reward


async def test_sandbox_and_grader_start_the_tasks_image(fake: Fake) -> None:
    image = fake.root / "mdurl.sif"
    image.write_bytes(b"SIF-task")
    task = with_spec(image=str(image), python="3.11", test_cmd="pytest -rA")
    await init_and_eval(task, fake.factory())

    starts = fake.starts()
    assert len(starts) == 2  # the job's sandbox and its grading sandbox; no venv build sandbox
    for start in starts:
        assert start[-2] == str(image)  # the task's image, not the server's
        assert not any(b.endswith(f":{ENV_MOUNT}") or ":/.rollout-wheels" in b
                       for b in extra_binds(start))
        assert all(b.endswith(":ro") for b in extra_binds(start))
    # No venv was built, and the tests ran with the image's own interpreter and test_cmd.
    assert not (Path(fake.config.state_dir).parent / "envs").exists()
    grader = f"instance://rollout-{starts[1][-1].removeprefix('rollout-')}"
    test_runs = [c for c in fake.calls() if c[:1] == ["exec"] and "-p" in c]
    assert len(test_runs) == 1
    run = test_runs[0]
    assert run[run.index(grader) + 1:run.index(grader) + 3] == ["python3.11", "-c"]
    assert run[run.index("/workspace", run.index(grader)) + 1] == "-rA"
    named = named_tests(MDURL, "FAIL_TO_PASS") + named_tests(MDURL, "PASS_TO_PASS")
    # The named tests, then the honeypots planted beside them (grading/honeypots.py): one
    # must-fail and one must-pass per test file, in the same file.
    tail = run[-(len(named) + 2):]
    assert tail[:len(named)] == named
    assert all(t.startswith("tests/test_mdurl.py::") and t not in named for t in tail[len(named):])


async def test_a_task_without_an_image_binds_its_venv_read_only(fake: Fake) -> None:
    task = with_spec(pip_packages=["pytest==8.3.5"])
    spec = EnvSpec.of(task)
    assert spec is not None and not spec.image
    # A venv some earlier job built (building one would run the recipe on this host, since
    # the stand-in isolates nothing).
    env_dir = Path(fake.log).parent / "envs" / spec.key
    (env_dir / "venv" / "bin").mkdir(parents=True)
    (env_dir / "ready").write_text("{}")
    await init_and_eval(task, fake.factory())

    starts = fake.starts()
    assert len(starts) == 2
    for start in starts:
        assert start[-2] == str(fake.server_image)
        assert extra_binds(start) == [f"{env_dir}:{ENV_MOUNT}:ro"]
    run = next(c for c in fake.calls() if c[:1] == ["exec"] and "-p" in c)
    assert run[run.index(f"instance://{starts[1][-1]}") + 1] == "python"  # the venv's, on PATH


async def test_a_bwrap_server_refuses_a_task_image(fake: Fake, tmp_path: Path) -> None:
    image = fake.root / "mdurl.sif"
    image.write_bytes(b"SIF-task")
    task = with_spec(image=str(image))
    set_sandbox_runtime("bwrap")
    with pytest.raises(InvalidArgument, match="runs bwrap") as e:
        SweHandler().validate_task(task)
    assert (e.value.reason, e.value.field) == ("INVALID_TASK", "task.spec.image")
    with pytest.raises(InvalidArgument, match="runs bwrap"):
        SweHandler().validate_task(with_spec(image="oras://ghcr.io/x/y:1"))
    # A reference of the image cache runs on bwrap too (tests/runtime/images).
    SweHandler().validate_task(with_spec(image="docker://python:3.11"))
    set_sandbox_runtime("apptainer")
    SweHandler().validate_task(task)

    # Without the server's setting (library use), INIT asks the factory and says the same.
    set_sandbox_runtime(None)
    bwrap = functools.partial(create_sandbox, SandboxConfig(state_dir=tmp_path / "state"))
    assert runtime_of(bwrap) == "bwrap" and runtime_of(fake.factory()) == "apptainer"
    with pytest.raises(HandlerError, match="needs the apptainer sandbox runtime; this server "
                                           "runs bwrap"):
        await init_and_eval(task, bwrap)
    assert fake.starts() == []


async def test_image_paths_outside_the_allowed_roots_are_refused(fake: Fake) -> None:
    outside = Path(fake.log).parent / "outside.sif"
    outside.write_bytes(b"SIF-elsewhere")
    link = fake.root / "inside-looking.sif"
    link.symlink_to(outside)
    for image in (str(outside), str(link), "../../../../" + str(outside).lstrip("/")):
        with pytest.raises(InvalidArgument, match="outside the directories") as e:
            SweHandler().validate_task(with_spec(image=image))
        assert (e.value.reason, e.value.field) == ("PATH_NOT_ALLOWED", "task.spec.image")
    with pytest.raises(InvalidArgument, match="does not exist"):
        SweHandler().validate_task(with_spec(image=str(fake.root / "missing.sif")))
    with pytest.raises(InvalidArgument, match="docker:// or oras://"):
        SweHandler().validate_task(with_spec(image="http://example.org/x.sif"))
    with pytest.raises(InvalidArgument, match=r"\['spec.install'\] would never run"):
        SweHandler().validate_task(with_spec(image="docker://python:3.11", install="pip i ."))
    assert fake.calls() == []


async def test_prepare_pulls_each_image_once_and_jobs_start_the_cached_sif(
        fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = fake.root / "env.def"
    recipe.write_text("Bootstrap: docker\nFrom: python:3.11\n")
    local = fake.root / "local.sif"
    local.write_bytes(b"SIF-local")
    images = ["docker://ghcr.io/x/sweb.eval.mdurl-1:latest", "oras://ghcr.io/x/other:1",
              "docker://ghcr.io/x/sweb.eval.mdurl-1:latest", str(recipe), str(local)]
    file = fake.root / "tasks.jsonl"
    file.write_text("".join(json.dumps({**with_spec(image=img), "instance_id": f"t{i}"}) + "\n"
                            for i, img in enumerate(images)))
    state = Path(fake.log).parent / "state"
    wheels = Path(fake.log).parent / "wheels"

    rows = await prepare(file, wheels, state, runtime="apptainer")
    acted = [(r["image"], r["action"]) for r in rows if "image" in r]
    assert acted == [(images[0], "pulled"), (images[1], "pulled"), (str(recipe), "built"),
                     (str(local), "local")]
    fetches = [c for c in fake.calls() if c[0] in ("pull", "build")]
    assert [(c[0], c[-1]) for c in fetches] == [("pull", images[0]), ("pull", images[1]),
                                                ("build", str(recipe))]
    cache = Path(fake.log).parent / "sif-cache"
    assert Path(rows[0]["path"]) == cached_sif(images[0], cache)
    assert Path(rows[0]["path"]).read_text() == f"SIF of {images[0]}"

    # A second prepare (here through the command) finds everything cached.
    # (in a thread: the command runs its own event loop)
    assert await asyncio.to_thread(tasks_main, [
        "prepare", str(file), "--runtime", "apptainer", "--wheelhouse", str(wheels),
        "--state-dir", str(state)]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("action") for r in out if "image" in r] == ["cached", "cached", "cached",
                                                               "local"]
    assert out[-1]["image_cache"] == str(cache)
    assert len([c for c in fake.calls() if c[0] in ("pull", "build")]) == 3

    # An edited recipe is a new image: built again rather than reusing the old SIF.
    recipe.write_text("Bootstrap: docker\nFrom: python:3.12\n")
    rows = await prepare(file, wheels, state, runtime="apptainer")
    assert [r["action"] for r in rows if "image" in r] == ["cached", "cached", "built", "local"]

    # A job of a pulled image starts the cached SIF, not a fresh pull per job.
    await init_and_eval(with_spec(image=images[1]), fake.factory())
    assert [s[-2] for s in fake.starts()] == [str(cached_sif(images[1], cache))] * 2

    # Under bwrap, prepare refuses the file as the server would, before pulling anything.
    assert await asyncio.to_thread(tasks_main, [
        "prepare", str(file), "--wheelhouse", str(wheels), "--state-dir", str(state)]) == 2
    assert "runs bwrap" in capsys.readouterr().err
