"""The installed layout: one `rollout.` namespace over the fixed folders, a light client.

A trainer installs the client into an environment full of its own modules; these tests run the
interpreter in a directory that holds modules named like our folders, the way a user's project
would, and check what the client pulls in.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"client": "rollout.client", "server": "rollout.server", "runtime": "rollout.runtime",
           "trainer_adapters": "rollout.trainer_adapters", "proto/rollout": "rollout",
           "entrypoints": "rollout.entrypoints", "benchmarks": "rollout.benchmarks"}


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_user_modules_named_like_our_folders_do_not_shadow_the_client(tmp_path: Path) -> None:
    for name in ("client", "server", "runtime", "trainer_adapters", "entrypoints", "benchmarks"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user module was imported')\n")
    proc = _run("from rollout.client.aio import RolloutClient\n"
                "from rollout.client.sync import RolloutClientSync\n"
                "import rollout.v1.rollout_service_pb2\n"
                "print(RolloutClient.__module__)", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "rollout.client.aio"


def test_the_client_library_and_the_command_line_import_no_server_code(tmp_path: Path) -> None:
    proc = _run("import sys\n"
                "import rollout.client, rollout.client.aio, rollout.client.sync, "
                "rollout.client.session, rollout.client.trajectory, rollout.client.specs, "
                "rollout.entrypoints.cli\n"
                "heavy = [m for m in sys.modules if m.startswith(('rollout.server', "
                "'rollout.runtime', 'torch', 'transformers'))]\n"
                "print(heavy)", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_every_package_folder_is_in_the_wheel() -> None:
    """A package folder missing from pyproject's list works in the editable install and is
    missing from the wheel: compare the list with the folders."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    assert config["package-dir"] == {v: k for k, v in FOLDERS.items()}
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
        # folders of data files (task sets, templates, presets) inside a package ship as
        # data-only packages (listed, so that setuptools does not warn)
        for d in (ROOT / folder).rglob("*"):
            if (d.is_dir() and "__pycache__" not in d.parts and not (d / "__init__.py").exists()
                    and any(f.is_file() for f in d.iterdir())):
                found.add(".".join([name, *d.relative_to(ROOT / folder).parts]))
    assert found == listed
