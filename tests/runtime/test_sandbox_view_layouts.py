"""The minimal view as one value (:class:`HostView`), run by real bwrap for each way the
service can be installed: the interpreter is reachable, the service's package (its shipped
task data, gold patches included) is not. The control emits the masks before the binds (the
order of the previous release) and the package of a wheel install in a venv outside ``/usr``
shows again."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout.runtime.sandbox.view import SYSTEM_PATHS, HostView

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")]


@dataclass(frozen=True)
class Layout:
    view: HostView
    python: str
    """The interpreter, which must be reachable."""
    secret: str
    """A shipped task file inside the service's package, which must not be."""


def _file(path: Path, text: str = "x") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _layout(name: str, root: Path) -> Layout:
    etc = root / "etc"
    etc.mkdir()
    site = "lib/python3.11/site-packages"
    if name == "wheel-in-venv-outside-usr":
        venv = root / "opt" / "venv"
        package = venv / site / "rollout"
        view = HostView(SYSTEM_PATHS, str(etc), interpreters=(str(venv),),
                        masked=(str(package),))
        python = _file(venv / "bin" / "python")
    elif name == "wheel-in-base-installation":
        base = root / "pyenv" / "versions" / "3.11.7"
        venv = root / "srv" / "venv"
        package = base / site / "rollout"
        view = HostView(SYSTEM_PATHS, str(etc), interpreters=(str(base), str(venv)),
                        masked=(str(package),))
        python = _file(venv / "bin" / "python")
    elif name == "checkout-with-venv-inside-bound-by-visible-paths":
        checkout = root / "work" / "main"
        package = checkout
        venv = checkout / ".venv"
        view = HostView(SYSTEM_PATHS, str(etc), visible=(str(root / "work"),),
                        interpreters=(str(venv),), masked=(str(checkout),))
        python = _file(venv / "bin" / "python")
    elif name == "wheel-in-a-system-tree":
        system = root / "usr-like"
        package = system / "lib" / "python3" / "dist-packages" / "rollout"
        view = HostView((*SYSTEM_PATHS, str(system)), str(etc), masked=(str(package),))
        python = _file(system / "bin" / "python3")
    else:  # an operator's tree holding a venv that holds the package
        tree = root / "opt"
        venv = tree / "venv"
        package = venv / site / "rollout"
        view = HostView(SYSTEM_PATHS, str(etc), visible=(str(tree),),
                        interpreters=(str(venv),), masked=(str(package),))
        python = _file(venv / "bin" / "python")
    secret = _file(package / "runtime" / "envs" / "data" / "swe.jsonl", "gold patch")
    return Layout(view, python, secret)


LAYOUTS = ["wheel-in-venv-outside-usr", "wheel-in-base-installation",
           "checkout-with-venv-inside-bound-by-visible-paths", "wheel-in-a-system-tree",
           "venv-inside-visible-paths"]


def _seen(args: tuple[str, ...], *paths: str) -> list[str]:
    """Which of ``paths`` exist inside a bwrap sandbox built from ``args``."""
    script = 'for p in "$@"; do [ -e "$p" ] && echo "$p"; done; true'
    proc = subprocess.run(["bwrap", "--unshare-user", "--unshare-pid", *args,
                           "/bin/sh", "-c", script, "probe", *paths],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.fixture
def root() -> Path:
    # Not under /tmp, which the tests' own sandboxes replace; readable by any uid.
    path = Path(os.environ.get("ROLLOUT_TEST_VIEW_ROOT", "/var/tmp")) / f"view-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_interpreter_is_reachable_and_the_package_is_not(name: str, root: Path) -> None:
    layout = _layout(name, root)
    assert _seen(layout.view.args(), layout.python, layout.secret) == [layout.python]


def test_binds_come_first_and_masks_last() -> None:
    view = HostView(("/usr",), "/etc-copy", interpreters=("/usr",), masked=())
    assert view.args()[:6] == ("--tmpfs", "/", "--ro-bind", "/usr", "/usr", "--ro-bind")


def _masks_first(view: HostView) -> tuple[str, ...]:
    """The previous release's order: masks emitted before the interpreter's bind."""
    args = list(view.args())
    masks: list[str] = []
    while "--tmpfs" in args[2:]:
        i = args.index("--tmpfs", 2)
        masks += args[i:i + 2]
        del args[i:i + 2]
    at = args.index("/dev") + 1
    return (*args[:at], *masks, *args[at:])


def test_control_masks_before_the_interpreter_bind_show_the_package(root: Path) -> None:
    layout = _layout("wheel-in-venv-outside-usr", root)
    assert layout.secret in _seen(_masks_first(layout.view), layout.secret)
