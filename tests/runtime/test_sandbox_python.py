"""The server's Python stays usable inside the sandbox wherever it is installed, including a
virtual environment in a checkout under /tmp, which the sandbox covers with its own /tmp (CI
clones there)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.runtime.sandbox import create_sandbox
from tests.runtime.sandbox_helpers import temp_config


@pytest.mark.timeout(60)
async def test_a_venv_under_tmp_runs_inside_the_sandbox(tmp_path: Path) -> None:
    venv = Path("/tmp") / f"rollout-venv-test-{tmp_path.name}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    try:
        with temp_config("pyvenv-") as cfg:
            cfg = dataclasses.replace(cfg, python=str(venv / "bin" / "python"))
            sb = await create_sandbox(cfg)
            try:
                res = await sb.exec("python -c 'import sys; print(sys.prefix)'", timeout=20)
                assert res.exit_code == 0, res.output
                assert res.stdout.strip() == str(venv)
                # The sandbox's /tmp is still its own and writable.
                assert (await sb.exec("touch /tmp/x && ls /tmp/x", timeout=10)).exit_code == 0
            finally:
                await sb.destroy()
    finally:
        subprocess.run(["rm", "-rf", str(venv)], check=True)
