"""``rollout tasks prepare`` runs nothing a task supplies on the host: ``spec.pip_packages``
must be plain requirement specifiers (a path, a URL, an option are refused with a clear error,
and nothing of them runs), the host downloads binary wheels only, and a package without one is
built in a sandbox."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from rollout.runtime.envs.swe import taskenv
from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.tasksets import shipped as tasks_mod
from rollout.runtime.tasksets.requirements import requirement
from rollout.runtime.tasksets.shipped import fill_wheelhouse, load_tasks
from rollout.runtime.types import InvalidArgument

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]

UNITCONV = next(t for t in load_tasks("swe") if t["instance_id"] == "rollout__unitconv-1")

BACKEND = '''\
import os, zipfile
try:  # proves where it ran: on the host this path exists, in a sandbox it does not
    with open({marker!r}, "w") as f:
        f.write("build code ran here")
except OSError:
    pass
META = "Metadata-Version: 2.1\\nName: {name}\\nVersion: 0.1\\n"
def get_requires_for_build_wheel(config_settings=None):
    return []
def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    d = os.path.join(metadata_directory, "{name}-0.1.dist-info")
    os.makedirs(d)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(META)
    return "{name}-0.1.dist-info"
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = "{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        z.writestr("{name}/__init__.py", "")
        z.writestr("{name}-0.1.dist-info/METADATA", META)
        z.writestr("{name}-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\\nGenerator: t\\n"
                   "Root-Is-Purelib: true\\nTag: py3-none-any\\n")
        z.writestr("{name}-0.1.dist-info/RECORD", "")
    return name
'''
PYPROJECT = ('[project]\nname = "{name}"\nversion = "0.1"\n[build-system]\nrequires = []\n'
             'build-backend = "backend"\nbackend-path = ["."]\n')


def project(where: Path, name: str, marker: Path) -> Path:
    """A project whose build code writes ``marker`` when it can."""
    where.mkdir(parents=True)
    (where / "backend.py").write_text(BACKEND.format(marker=str(marker), name=name))
    (where / "pyproject.toml").write_text(PYPROJECT.format(name=name))
    return where


def sdist(into: Path, name: str, marker: Path) -> Path:
    """The same project as an sdist (no wheel of it anywhere)."""
    into.mkdir(parents=True, exist_ok=True)
    path = into / f"{name}-0.1.tar.gz"
    files = {"backend.py": BACKEND.format(marker=str(marker), name=name),
             "pyproject.toml": PYPROJECT.format(name=name),
             "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n"}
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-0.1/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def task_file(tmp_path: Path, packages: list[str]) -> Path:
    path = tmp_path / "tasks.jsonl"
    task = {**UNITCONV, "spec": {**UNITCONV["spec"], "pip_packages": packages}}
    path.write_text(json.dumps({"environment": "swe", "task": task}) + "\n")
    return path


def prepare(tmp_path: Path, file: Path) -> int:
    return tasks_mod.main(["prepare", str(file), "--wheelhouse", str(tmp_path / "wheelhouse"),
                           "--state-dir", str(tmp_path / "state")])


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No registry: everything comes from local wheelhouses; caches are the test's own."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("ROLLOUT_SWE_ENV_CACHE", str(tmp_path / "envs"))
    monkeypatch.setenv("ROLLOUT_SWE_SOURCE_CACHE", str(tmp_path / "sources"))
    monkeypatch.setenv("ROLLOUT_WHEELHOUSE", str(tmp_path / "wheelhouse"))


def test_prepare_refuses_a_path_a_url_and_an_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker, log = tmp_path / "setup-ran-on-host", tmp_path / "pip.log"
    local = project(tmp_path / "evil", "evilpkg", marker)
    cases = {str(local): "is a path", "./evil": "is a path",
             "https://example.invalid/evil-0.1.tar.gz": "is a URL",
             "evilpkg @ file:///tmp/evil": "is a URL", f"--log={log}": "is a pip option",
             "evilpkg; python_version > '3'": "environment marker",
             "evil-0.1.tar.gz": "names a file"}
    for value, why in cases.items():
        assert prepare(tmp_path, task_file(tmp_path, [value])) == 2, value
        err = capsys.readouterr().err
        assert why in err and "spec.pip_packages" in err and "pytest==8.3.5" in err, err
    assert not marker.exists() and not log.exists()


@pytest.mark.slow
def test_prepare_takes_a_requirement_specifier(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Control: a plain specifier (in the shipped wheelhouse) prepares the environment."""
    assert prepare(tmp_path, task_file(tmp_path, ["tinyunits == 0.1.0"])) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(row.get("built") is True for row in rows), rows


def test_without_the_check_a_local_path_runs_its_build_code_on_the_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control for the refusal above: let the path through and pip builds it on the host."""
    marker = tmp_path / "setup-ran-on-host"
    local = project(tmp_path / "evil", "evilpkg", marker)
    monkeypatch.setattr(taskenv, "requirement", lambda value: value)
    prepare(tmp_path, task_file(tmp_path, [str(local)]))
    assert marker.read_text() == "build code ran here"


def test_requirements_are_handed_on_in_canonical_form() -> None:
    assert requirement(" numpy >= 1.26 , < 2 ") == "numpy<2,>=1.26"
    assert requirement("requests[socks]==2.32.0") == "requests[socks]==2.32.0"
    with pytest.raises(InvalidArgument) as err:
        requirement("-r requirements.txt")
    assert err.value.field == "task.spec.pip_packages"


async def test_a_package_without_a_wheel_is_built_in_a_sandbox(tmp_path: Path) -> None:
    marker = tmp_path / "build-ran-on-host"
    wheelhouse = tmp_path / "wheelhouse"
    sdist(wheelhouse, "sdistonly", marker)
    task = {**UNITCONV, "spec": {**UNITCONV["spec"], "pip_packages": ["sdistonly==0.1"]}}
    factory = functools.partial(create_sandbox, SandboxConfig(state_dir=tmp_path / "state"))
    loop = asyncio.get_running_loop()
    built: list[list[str]] = []

    def build(python: str, requirements: list[str], house: Path) -> None:
        built.append(requirements)
        asyncio.run_coroutine_threadsafe(
            taskenv.build_wheels(python, requirements, house, factory), loop).result()

    fetched = await asyncio.to_thread(fill_wheelhouse, [task], wheelhouse, build=build)
    assert built == [["sdistonly==0.1"]] and fetched == ["sdistonly==0.1"]
    assert (wheelhouse / "sdistonly-0.1-py3-none-any.whl").is_file()
    assert not marker.exists()  # its build code ran, but not on the host
    # Without a sandbox to build in, the host refuses rather than build it itself.
    (wheelhouse / "sdistonly-0.1-py3-none-any.whl").unlink()
    with pytest.raises(RuntimeError, match="nothing is built on the host"):
        await asyncio.to_thread(fill_wheelhouse, [task], wheelhouse)
    assert not marker.exists()

