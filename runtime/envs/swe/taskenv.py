"""Per-task Python environments for swe tasks, isolated from the server's interpreter, the way
the SWE-bench harness builds one environment per repository and version.

A task opts in with a ``spec`` object (the harness's spec fields)::

    "version": "0.3",                      # the repository version the environment is for
    "spec": {
      "python": "3.11",                    # optional; an interpreter this server has
      "pre_install": ["sed -i ... setup.cfg"],   # optional shell commands in the checkout
      "pip_packages": ["pytest==8.3.5", "tinyunits==0.1.0"],   # specifiers only; from the
                                                                 # wheelhouse only
      "install": "python -m pip install --no-build-isolation --no-deps -e .",  # optional
      "test_cmd": "pytest -rA"             # optional: pytest, ./tests/runtests.py (Django),
                                           # bin/test (SymPy) or python -m unittest; only
                                           # its options are kept (runtime.envs.swe.runners)
    }

The environment is a venv built once per (repository, version, spec) in a build sandbox with no
network: ``pip`` reads only the wheelhouses (``--no-index``): the shipped one
(``runtime/envs/data/wheelhouse``: what the shipped tasks need, so they build offline out of the
box; ``SOURCES.txt`` there lists each wheel's hash) and ``$ROLLOUT_WHEELHOUSE`` (default
``~/.cache/rollout/wheelhouse``), which ``rollout tasks prepare FILE``
fills ahead of time on a machine with registry access. The finished venv sits in
``$ROLLOUT_SWE_ENV_CACHE`` (default ``~/.cache/rollout/swe-envs``) and every later job of the
same repository binds it read-only at :data:`ENV_MOUNT`: INIT pays nothing for it, and no agent
can change the environment its own grader (or another job) uses. It is built at the same path
it is used at, so its scripts and the editable install's paths (``/workspace/src``) hold in
every sandbox.

Per-instance images, the way the SWE-bench harness runs one image per instance: on a server
whose sandbox runtime is Apptainer, ``"spec": {"image": "docker://..."}`` (or ``oras://...``,
or a ``.sif`` file, sandbox directory or ``.def`` recipe under the server's allowed task path
roots) runs the job's sandbox and its grading sandbox from that image. No venv is built (the
image carries the environment, so ``pre_install``, ``pip_packages`` and ``install`` are
refused beside it); ``test_cmd`` runs with the image's ``python`` (``python3.11`` with
``"python": "3.11"``), and the image's own ``PATH``. ``rollout tasks prepare FILE --runtime
apptainer`` pulls or builds each distinct image once into ``$ROLLOUT_SIF_CACHE`` (default
``~/.cache/rollout/sif``); INIT starts the cached SIF when there is one, else hands a registry
reference to Apptainer as it is. On a bwrap server, an image reference of the image cache
(``docker://``, ``oci:``, ``oci-archive:``, ``docker-archive:``; docs/images.md) becomes the
sandbox's root, fetched into the cache on first use or by ``rollout tasks prepare``; any other
task image is refused at submit (:func:`set_sandbox_runtime`). Without an image, an Apptainer
server binds the venv like bwrap (``--bind DIR:/.rollout-env:ro``); that venv is made from the
server's interpreter path, which the server's Apptainer image must then hold at the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from rollout.runtime.envs.common import DATA_DIR, host_path, invalid
from rollout.runtime.envs.swe.runners import split_test_cmd
from rollout.runtime.handler import HandlerError
from rollout.runtime.sandbox.images import ImageError, is_image_ref, parse_image_ref
from rollout.runtime.sandbox.view import interpreter_binds
from rollout.runtime.tasksets.requirements import requirement

ENV_MOUNT = "/.rollout-env"
VENV = f"{ENV_MOUNT}/venv"
SHIPPED_WHEELHOUSE = DATA_DIR / "wheelhouse"
_WHEEL_MOUNT = "/.rollout-wheels-{}"
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SPEC_FIELDS = ("python", "pre_install", "pip_packages", "install", "test_cmd", "image")
_BUILD_FIELDS = ("pre_install", "pip_packages", "install")
_IMAGE_SCHEMES = ("docker", "oras")
_MAX_IMAGE_REF = 1000
_LOCKS: dict[str, asyncio.Lock] = {}
_SANDBOX_RUNTIME: str | None = None


def set_sandbox_runtime(runtime: str | None) -> str | None:
    """Tell task validation which sandbox runtime this server runs (``bwrap`` or
    ``apptainer``), so a task image is refused at submit on bwrap instead of failing in INIT;
    returns the previous setting. None (library use, no server) leaves the check to INIT,
    which asks the sandbox factory."""
    global _SANDBOX_RUNTIME
    previous, _SANDBOX_RUNTIME = _SANDBOX_RUNTIME, runtime
    return previous

_BUILD = r"""
set -euo pipefail
py=$1 install=$2; shift 2
pre=() pkgs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do pre+=("$1"); shift; done
shift
pkgs=("$@")
for cmd in ${pre[@]+"${pre[@]}"}; do bash -c "$cmd"; done
"$py" -m venv __VENV__
export PATH=__VENV__/bin:$PATH VIRTUAL_ENV=__VENV__
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
export PIP_FIND_LINKS=__ENV__/wheels
# Exactly the wheels of the task's lock, each checked against its hash: nothing another
# task's build put into the shared wheelhouse reaches this environment.
if [ ${#pkgs[@]} -gt 0 ]; then
  python -m pip install -q --require-hashes --no-deps -r __ENV__/lock.txt
fi
if [ -n "$install" ]; then bash -c "$install"; fi
python -m pip freeze --all
""".replace("__VENV__", VENV).replace("__ENV__", ENV_MOUNT)


@dataclass(frozen=True)
class EnvSpec:
    """The spec fields of one task (see the module docstring)."""

    python: str
    """The interpreter (host path) the venv is made from."""
    pre_install: tuple[str, ...]
    pip_packages: tuple[str, ...]
    install: str
    test_cmd: tuple[str, ...]
    """The options of ``test_cmd`` (the runner itself is always the grader's)."""
    key: str
    """Cache key: repository, version and every spec field."""
    test_runner: str = ""
    """The runner ``test_cmd`` names ('' without one; see :mod:`.swe_runners`)."""
    image: str = ""
    """The task's own image ('' = none): a ``docker://``/``oras://`` reference, or a local
    image's real path (inside the allowed roots)."""

    @property
    def run_python(self) -> str:
        """The interpreter name the grader's commands use inside the sandbox: the venv's
        ``python`` (first on PATH), or the image's own (``python3.11`` for "3.11")."""
        return self.python if self.image else "python"

    @classmethod
    def of(cls, task: Mapping[str, Any]) -> EnvSpec | None:
        """The task's spec, validated (INVALID_TASK names the field); None without one."""
        spec = task.get("spec")
        if spec is None:
            return None
        if not isinstance(spec, Mapping):
            raise invalid("swe task field 'spec' must be an object with the fields "
                          f"{list(_SPEC_FIELDS)}", "spec")
        unknown = sorted(set(spec) - set(_SPEC_FIELDS))
        if unknown:
            raise invalid(f"swe task field 'spec' has unknown fields {unknown}; known: "
                          f"{list(_SPEC_FIELDS)}", "spec")
        lists = {}
        for name in ("pre_install", "pip_packages"):
            value = spec.get(name, [])
            if not isinstance(value, list) or not all(isinstance(v, str) and v.strip()
                                                      for v in value):
                raise invalid(f"swe task field 'spec.{name}' must be a list of strings",
                              f"spec.{name}")
            lists[name] = tuple(value)
        lists["pip_packages"] = tuple(requirement(v) for v in lists["pip_packages"])
        for name in ("install", "test_cmd", "python"):
            if not isinstance(spec.get(name, ""), str):
                raise invalid(f"swe task field 'spec.{name}' must be a string", f"spec.{name}")
        try:
            runner, test_cmd = split_test_cmd(str(spec.get("test_cmd") or ""))
        except ValueError as e:
            raise invalid(f"swe task field {e}", "spec.test_cmd") from None
        image = image_ref(spec.get("image"))
        if image:
            given = [f"spec.{n}" for n in _BUILD_FIELDS if spec.get(n)]
            if given:
                raise invalid(f"swe task field 'spec.image' names an image that carries the "
                              f"environment, so {given} would never run: drop them, or drop "
                              "'spec.image' to have the server build a venv", "spec.image")
            python = image_python(str(spec.get("python", "")))
        else:
            python = find_python(str(spec.get("python", "")))
        # The build script is part of the key: a changed recipe never reuses an old venv.
        fingerprint = {"repo": task.get("repo", ""), "version": str(task.get("version", "")),
                       "python": python, "recipe": hashlib.sha256(_BUILD.encode()).hexdigest(),
                       **{k: spec.get(k) for k in _SPEC_FIELDS}}
        key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        return cls(python, lists["pre_install"], lists["pip_packages"],
                   str(spec.get("install", "")), test_cmd, key, runner, image)


def image_ref(value: Any) -> str:
    """A task's ``spec.image``, checked ('' when absent): a registry reference Apptainer
    resolves, or a local image inside the server's allowed task path roots (permission before
    existence, as for every host path a task names); refused on a bwrap server."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or len(value) > _MAX_IMAGE_REF or not value.strip() or any(
            c.isspace() for c in value):
        raise invalid("swe task field 'spec.image' must be one image reference without "
                      f"spaces, at most {_MAX_IMAGE_REF} characters", "spec.image")
    if is_image_ref(value):
        # docker://, oci:, oci-archive:, docker-archive: run on both runtimes through the
        # image cache (runtime/sandbox/images); a local layout or archive is a host path.
        try:
            ref = parse_image_ref(value)
        except ImageError as e:
            raise invalid(f"swe task field 'spec.image': {e}", "spec.image") from e
        if not ref.is_remote:
            host_path(ref.target, "spec.image", env="swe")
        return value
    if _SANDBOX_RUNTIME == "bwrap":
        raise invalid(
            "swe task field 'spec.image' needs the apptainer sandbox runtime, and this server "
            "runs bwrap: drop 'spec.image' (give 'spec.pip_packages'/'spec.install' so the "
            "server builds the task a venv) or submit to a server started with "
            "sandbox.runtime = 'apptainer'", "spec.image")
    if "://" in value:
        scheme, rest = value.split("://", 1)
        if scheme not in _IMAGE_SCHEMES or not rest:
            raise invalid(f"swe task field 'spec.image' must be a docker:// or oras:// "
                          f"reference or a local path, got scheme {scheme!r}", "spec.image")
        return value
    path = host_path(value, "spec.image", env="swe")
    if not path.exists():
        raise invalid(f"swe task field 'spec.image': {path} does not exist on the server "
                      "(a .sif file, a sandbox directory or a .def recipe)", "spec.image")
    return str(path)


def image_python(version: str) -> str:
    """The interpreter inside a task image: ``python`` or ``pythonX.Y`` (looked up on the
    image's PATH, not the server's)."""
    if not version:
        return "python"
    if not all(part.isdigit() for part in version.split(".")) or version.count(".") != 1:
        raise invalid(f"swe task field 'spec.python' must look like '3.11', got {version!r}",
                      "spec.python")
    return f"python{version}"


def image_cache_dir() -> Path:
    """Where ``rollout tasks prepare`` puts pulled and built SIF files."""
    return Path(os.environ.get("ROLLOUT_SIF_CACHE")
                or Path.home() / ".cache" / "rollout" / "sif")


def image_options(spec: EnvSpec, runtime: str | None = None) -> dict[str, Any]:
    """``open_sandbox`` options for a job that runs in its task's image: on bwrap (and for the
    local image references on Apptainer) the reference itself, which the sandbox takes from
    the image cache, fetching it on first use; on Apptainer the cached SIF when ``prepare``
    made one (a registry pull per job would cost minutes), else the reference itself for
    Apptainer to resolve. A ``.def`` recipe has to be built by ``prepare``."""
    from rollout.runtime.sandbox.apptainer import cached_sif, is_remote, needs_cache

    image = spec.image
    if is_image_ref(image) and (runtime == "bwrap" or not image.startswith("docker://")):
        return {"image": image}
    if needs_cache(image):
        sif = cached_sif(image, image_cache_dir())
        if sif.is_file():
            image = str(sif)
        elif not is_remote(image):
            raise HandlerError(f"the task's image recipe {spec.image} is not built yet: run "
                               "`rollout tasks prepare FILE --runtime apptainer` on this "
                               f"server (cache: {image_cache_dir()})", "ENV_BUILD_FAILED")
    return {"image": image}


def find_python(version: str) -> str:
    """The host interpreter for ``"3.11"`` ("" = the server's own version)."""
    own = f"{sys.version_info.major}.{sys.version_info.minor}"
    if version in ("", own):
        # The server's base interpreter: the sandbox always binds its prefix back in.
        return os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    if not all(part.isdigit() for part in version.split(".")) or version.count(".") != 1:
        raise invalid(f"swe task field 'spec.python' must look like '3.11', got {version!r}",
                      "spec.python")
    found = shutil.which(f"python{version}")
    if found is None or not found.startswith(("/usr/", "/opt/")):
        raise invalid(f"this server has no Python {version} (python{version} under /usr or "
                      f"/opt); it has {own}: install that version or drop 'spec.python'",
                      "spec.python")
    return os.path.realpath(found)


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_SWE_ENV_CACHE")
                or Path.home() / ".cache" / "rollout" / "swe-envs")


def user_wheelhouses() -> list[Path]:
    """``$ROLLOUT_WHEELHOUSE`` (``:``-separated), default ``~/.cache/rollout/wheelhouse``."""
    user = os.environ.get("ROLLOUT_WHEELHOUSE") or str(
        Path.home() / ".cache" / "rollout" / "wheelhouse")
    return [Path(p) for p in user.split(os.pathsep) if p]


def wheelhouses() -> list[Path]:
    """Where pip may take packages from: the shipped wheelhouse, then the user's."""
    return [d for d in (SHIPPED_WHEELHOUSE, *user_wheelhouses()) if d.is_dir()]


def sandbox_options(env_dir: Path) -> dict[str, Any]:
    """``open_sandbox`` options for a job that uses the environment in ``env_dir``: the venv,
    and the interpreter it was made from where a sandbox would not see it otherwise."""
    return {"binds": [(str(env_dir), ENV_MOUNT, False), *interpreter_binds(_venv_home(env_dir))],
            "env": {"PATH": f"{VENV}/bin:{_BASE_PATH}", "VIRTUAL_ENV": VENV}}


def _venv_home(env_dir: Path) -> str:
    """The interpreter a built venv runs (``home`` of its ``pyvenv.cfg``)."""
    try:
        for line in (env_dir / "venv" / "pyvenv.cfg").read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() == "home":
                return os.path.join(value.strip(), "python")
    except OSError:
        pass
    return sys.executable


def ready(spec: EnvSpec) -> Path | None:
    path = cache_dir() / spec.key
    return path if (path / "ready").is_file() else None


PrepareRepo = Callable[[Any], Awaitable[None]]
"""Checks the task's repository out into a build sandbox's workspace."""


async def ensure_env(spec: EnvSpec, sandbox_factory: Callable[..., Awaitable[Any]],
                     prepare_repo: PrepareRepo, *, timeout: float = 900.0  # noqa: ASYNC109
                     ) -> tuple[Path, bool]:
    """The environment's directory, built now if no job built it before; (path, built)."""
    if (path := ready(spec)) is not None:
        return path, False
    lock = _LOCKS.setdefault(spec.key, asyncio.Lock())
    async with lock:
        if (path := ready(spec)) is not None:
            return path, False
        root = cache_dir()
        await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
        fd = await asyncio.to_thread(_flock, root / f".{spec.key}.lock")
        try:
            if (path := ready(spec)) is not None:  # another server process built it
                return path, False
            return await _build(spec, sandbox_factory, prepare_repo, timeout), True
        finally:
            os.close(fd)


def _flock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


async def _build(spec: EnvSpec, sandbox_factory: Callable[..., Awaitable[Any]],
                 prepare_repo: PrepareRepo, timeout: float) -> Path:  # noqa: ASYNC109
    root = cache_dir()
    tmp = root / f".{spec.key}.{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(tmp.mkdir, 0o755)
    binds = [(str(tmp), ENV_MOUNT, True), *interpreter_binds(spec.python)]
    try:
        if spec.pip_packages:
            await asyncio.to_thread(lock_wheels, spec.python, list(spec.pip_packages), tmp)
        sandbox = await sandbox_factory(binds=binds)
        try:
            if (owner := sandbox.owner()) is not None:
                os.chown(tmp, *owner)
            await prepare_repo(sandbox)
            started = time.monotonic()
            result = await sandbox.exec(
                ["bash", "-c", _BUILD, "build", spec.python, spec.install, *spec.pre_install,
                 "--", *spec.pip_packages],
                timeout=timeout, cwd=sandbox.workspace_in_sandbox)
            if not result.ok:
                raise HandlerError(
                    f"building the task's environment failed (exit {result.exit_code}); is "
                    "every package in the wheelhouse? (`rollout tasks "
                    f"prepare FILE` fills it): {result.output[-1500:]}", "ENV_BUILD_FAILED")
        finally:
            await sandbox.destroy()
        await asyncio.to_thread(_seal, tmp, result.stdout, time.monotonic() - started)
        final = root / spec.key
        await asyncio.to_thread(os.rename, tmp, final)
        return final
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        raise


_WHEEL_OUT = "/.rollout-wheels-out"
_PIP_SETTINGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_CERT",
                 "PIP_DEFAULT_TIMEOUT", "PIP_NO_INDEX")
"""Host pip settings a build sandbox gets (where to download from); nothing else of the
host's environment or configuration."""


async def build_wheels(python: str, requirements: list[str], wheelhouse: Path,
                       sandbox_factory: Callable[..., Awaitable[Any]], *,
                       timeout: float = 1800.0) -> list[str]:  # noqa: ASYNC109
    """Build wheels of ``requirements`` (checked specifiers) and their dependencies with
    ``python`` in a sandbox, and copy the ``.whl`` files it made into ``wheelhouse``; returns
    their names. A package without a binary wheel runs its own build code (``setup.py``): only
    ever here, in a sandbox with the network (to download it) and nothing else of the host."""
    out = Path(tempfile.mkdtemp(prefix="rollout-wheels-"))
    houses = wheelhouses()
    binds = [(str(out), _WHEEL_OUT, True), *interpreter_binds(python)]
    binds += [(str(h), _WHEEL_MOUNT.format(i), False) for i, h in enumerate(houses)]
    env = {k: v for k, v in os.environ.items() if k in _PIP_SETTINGS}
    env["PIP_FIND_LINKS"] = " ".join(_WHEEL_MOUNT.format(i) for i in range(len(houses)))
    try:
        sandbox = await sandbox_factory(binds=binds, network="loopback")
        try:
            if (owner := sandbox.owner()) is not None:
                os.chown(out, *owner)
            result = await sandbox.exec(
                [python, "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
                 "--no-deps", "--wheel-dir", _WHEEL_OUT, "--", *requirements],
                env=env, timeout=timeout, cwd=sandbox.workspace_in_sandbox)
            if not result.ok:
                raise HandlerError(f"building wheels of {requirements} in a sandbox failed "
                                   f"(exit {result.exit_code}): {result.output[-1500:]}",
                                   "ENV_BUILD_FAILED")
        finally:
            await sandbox.destroy()
        return await asyncio.to_thread(_take_wheels, out, wheelhouse, requirements)
    finally:
        await asyncio.to_thread(shutil.rmtree, out, True)


def _take_wheels(out: Path, wheelhouse: Path, requirements: list[str]) -> list[str]:
    """Copy the wheels a build sandbox wrote of the distributions it was asked for (regular
    ``*.whl`` files only, never following its links). A wheel of any other distribution was
    put there by the build code (a ``setup.py`` dropping a wheel named like a common build
    dependency, whose ``.pth`` would run in every environment that installs it): the whole
    build is refused, naming it. A wheel already in the wheelhouse is never replaced."""
    from rollout.runtime.sandbox import hostfs

    asked = {canonicalize_name(Requirement(r).name) for r in requirements}
    names = sorted(n for n in os.listdir(out) if n.endswith(".whl"))
    unasked = [n for n in names if _wheel_name(n) not in asked]
    if unasked:
        raise HandlerError(f"building {requirements} in a sandbox wrote wheels of "
                           f"distributions nobody asked for: {unasked}; refused (nothing of "
                           "this build was put into the wheelhouse)", "ENV_BUILD_FAILED")
    taken = []
    for name in names:
        if hostfs.kind_beneath(out, name) != "file":
            continue
        data = hostfs.read_beneath(out, name, 1 << 31)
        target = wheelhouse / name
        if target.exists():
            if target.read_bytes() != data:
                raise HandlerError(f"building {requirements} in a sandbox wrote {name}, and "
                                   f"the wheelhouse {wheelhouse} already holds a different "
                                   "wheel of that name; refused (a wheel is never replaced)",
                                   "ENV_BUILD_FAILED")
            continue
        tmp = wheelhouse / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_bytes(data)
        try:
            os.link(tmp, target)  # fails if the name appeared meanwhile: never replaced
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        taken.append(name)
    return taken


def _wheel_name(filename: str) -> str:
    try:
        return str(parse_wheel_filename(filename)[0])
    except InvalidWheelFilename:
        return filename


def lock_wheels(python: str, requirements: list[str], env_dir: Path) -> list[str]:
    """The task's lock: resolve ``requirements`` against the wheelhouses on the host (binary
    wheels only, no index: nothing runs), copy exactly the wheels chosen into
    ``env_dir/wheels`` and write ``env_dir/lock.txt`` (``name==version --hash=sha256:...``
    per wheel), which the build installs with ``--require-hashes``. Returns its lines."""
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    links = [a for h in wheelhouses() for a in ("--find-links", str(h))]
    wheels = env_dir / "wheels"
    wheels.mkdir(mode=0o755)
    with tempfile.TemporaryDirectory(prefix="rollout-lock-") as scratch:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-index", *links,
             "--python-version", version, "--only-binary=:all:",
             "--disable-pip-version-check", "-d", scratch, "--", *requirements],
            capture_output=True, text=True, cwd=scratch)
        if proc.returncode != 0:
            raise HandlerError(f"the wheelhouse cannot satisfy {requirements} for Python "
                               f"{version} (`rollout tasks prepare FILE` fills it): "
                               f"{proc.stderr[-1500:]}", "ENV_BUILD_FAILED")
        lines = []
        for name in sorted(os.listdir(scratch)):
            if not name.endswith(".whl"):
                continue
            data = (Path(scratch) / name).read_bytes()
            (wheels / name).write_bytes(data)
            dist, ver, *_ = parse_wheel_filename(name)
            lines.append(f"{dist}=={ver} --hash=sha256:{hashlib.sha256(data).hexdigest()}")
    (env_dir / "lock.txt").write_text("".join(f"{line}\n" for line in lines))
    return lines


def _seal(path: Path, freeze: str, seconds: float) -> None:
    """Hand the tree to the server's user (the build uid may be leased to another sandbox
    next) and mark it complete."""
    uid, gid = os.geteuid(), os.getegid()
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            with contextlib.suppress(OSError):
                os.lchown(os.path.join(dirpath, name), uid, gid)
    os.lchown(path, uid, gid)
    (path / "freeze.txt").write_text(freeze)
    (path / "ready").write_text(json.dumps({"built_s": round(seconds, 3)}))
