"""Finding 1: a task's source-only package, built in a sandbox as designed, dropped a wheel
named like a common dependency into the build's output, and ``prepare`` copied it into the
shared wheelhouse, where the next environment of an unrelated task installed it (a ``.pth``
in it runs in every interpreter of that environment, the grader's included). Now a build
keeps only the wheels of what it was asked for, refuses the rest by name, never replaces a
wheel, and every environment installs exactly its own lock, hash-checked."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from rollout.runtime.envs.swe import taskenv
from rollout.runtime.tasksets import shipped as tasks_mod
from rollout.runtime.tasksets.shipped import load_tasks

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]

UNITCONV = next(t for t in load_tasks("swe") if t["instance_id"] == "rollout__unitconv-1")
POISON = "iniconfig-9.9-py3-none-any.whl"
BACKEND = '''\
import os, zipfile
def _wheel(path, name, version, files):
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
        z.writestr(f"{dist}/METADATA",
                   f"Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\\nGenerator: t\\n"
                   "Root-Is-Purelib: true\\nTag: py3-none-any\\n")
        z.writestr(f"{dist}/RECORD", "")
def get_requires_for_build_wheel(config_settings=None):
    return []
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    # The poison: a wheel named like pytest's dependency, newer than any real one, whose
    # .pth runs in every interpreter of an environment that installs it.
    # pip copies only the returned wheel out of wheel_directory, so it goes straight into
    # the build's output folder (its path is in pip's own command line).
    for out in {wheel_directory, "/.rollout-wheels-out"}:
        if os.path.isdir(out):
            _wheel(os.path.join(out, "iniconfig-9.9-py3-none-any.whl"), "iniconfig", "9.9",
                   {"iniconfig/__init__.py": "", "poison.pth": "import os\\n"})
    name = "poisonpkg-0.1-py3-none-any.whl"
    _wheel(os.path.join(wheel_directory, name), "poisonpkg", "0.1",
           {"poisonpkg/__init__.py": ""})
    return name
'''


def poisoned_sdist(into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    files = {"backend.py": BACKEND,
             "pyproject.toml": '[project]\nname = "poisonpkg"\nversion = "0.1"\n'
                               '[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                               'backend-path = ["."]\n',
             "PKG-INFO": "Metadata-Version: 2.1\nName: poisonpkg\nVersion: 0.1\n"}
    with tarfile.open(into / "poisonpkg-0.1.tar.gz", "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"poisonpkg-0.1/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def task_file(tmp_path: Path, name: str, packages: list[str]) -> Path:
    path = tmp_path / f"{name}.jsonl"
    task = {**UNITCONV, "instance_id": f"rollout__unitconv-{name}", "version": name,
            "spec": {**UNITCONV["spec"], "pip_packages": packages}}
    path.write_text(json.dumps({"environment": "swe", "task": task}) + "\n")
    return path


def prepare(tmp_path: Path, file: Path, capsys: pytest.CaptureFixture[str]
            ) -> tuple[int, list[dict[str, object]], str]:
    rc = tasks_mod.main(["prepare", str(file), "--wheelhouse", str(tmp_path / "wheelhouse"),
                         "--state-dir", str(tmp_path / "state")])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines()], err


def env_of(rows: list[dict[str, object]]) -> Path:
    return Path(str(next(r["path"] for r in rows if "env" in r)))


def tree_hash(root: Path) -> str:
    """Every path, link target and file content below ``root``."""
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            digest.update(str(path.relative_to(root)).encode())
            digest.update(os.readlink(path).encode() if path.is_symlink()
                          else path.read_bytes())
    return digest.hexdigest()


def poisoned(env: Path) -> bool:
    return any(env.glob("venv/lib/python*/site-packages/poison.pth"))


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("ROLLOUT_SWE_ENV_CACHE", str(tmp_path / "envs"))
    monkeypatch.setenv("ROLLOUT_SWE_SOURCE_CACHE", str(tmp_path / "sources"))
    monkeypatch.setenv("ROLLOUT_WHEELHOUSE", str(tmp_path / "wheelhouse"))
    poisoned_sdist(tmp_path / "wheelhouse")


@pytest.mark.slow
def test_a_poisoned_build_is_refused_and_other_environments_stay_byte_identical(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, rows, err = prepare(tmp_path, task_file(tmp_path, "before", UNITCONV["spec"][
        "pip_packages"]), capsys)
    assert rc == 0, err
    before = env_of(rows)
    lock = (before / "lock.txt").read_text()
    assert "pytest==8.3.5 --hash=sha256:" in lock and "iniconfig==" in lock, lock
    hashes = tree_hash(before)

    rc, _, err = prepare(tmp_path, task_file(tmp_path, "evil", ["poisonpkg==0.1"]), capsys)
    assert rc == 2
    assert POISON in err and "nobody asked for" in err, err
    assert not (tmp_path / "wheelhouse" / POISON).exists()

    rc, rows, err = prepare(tmp_path, task_file(tmp_path, "after", UNITCONV["spec"][
        "pip_packages"]), capsys)
    assert rc == 0, err
    assert not poisoned(env_of(rows))
    assert tree_hash(before) == hashes


@pytest.mark.slow
def test_control_a_build_whose_every_wheel_is_taken_poisons_the_next_environment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The previous release's copy: every ``.whl`` the build wrote, replacing."""
    def take_all(out: Path, wheelhouse: Path, requirements: list[str]) -> list[str]:
        names = sorted(n for n in os.listdir(out) if n.endswith(".whl"))
        for name in names:
            shutil.copyfile(out / name, wheelhouse / name)
        return names

    monkeypatch.setattr(taskenv, "_take_wheels", take_all)
    rc, _, err = prepare(tmp_path, task_file(tmp_path, "evil", ["poisonpkg==0.1"]), capsys)
    assert rc == 0, err
    rc, rows, err = prepare(tmp_path, task_file(tmp_path, "after", UNITCONV["spec"][
        "pip_packages"]), capsys)
    assert rc == 0, err
    assert poisoned(env_of(rows))


def test_a_wheel_in_the_wheelhouse_is_never_replaced(tmp_path: Path) -> None:
    out, house = tmp_path / "out", tmp_path / "house"
    out.mkdir()
    house.mkdir()
    (house / "pkg-1.0-py3-none-any.whl").write_bytes(b"original")
    (out / "pkg-1.0-py3-none-any.whl").write_bytes(b"replacement")
    with pytest.raises(taskenv.HandlerError, match="never replaced"):
        taskenv._take_wheels(out, house, ["pkg==1.0"])
    assert (house / "pkg-1.0-py3-none-any.whl").read_bytes() == b"original"
