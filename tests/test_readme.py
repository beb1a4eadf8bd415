"""The README's and the guides' executed blocks: the grpcurl walkthrough, run command by command
against a live server, the error example and the trainer snippet.

The server is the real one (gRPC on loopback, SQLite store, bubblewrap sandboxes, the math
environment); only the model is the scripted testing policy, so the answer is deterministic.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.config import Config
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.scripted import ScriptedEngine
from rollout.server.llm.smollm2 import smollm2_dir
from tests.docs import block, text_block

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ADDRESS = "127.0.0.1:50051"
GRPCURL = ".venv/bin/grpcurl"
"""How the README calls grpcurl: the venv's copy, from the repository root (a new user's shell
has no ``grpcurl`` on its PATH)."""


def grpcurl_commands() -> list[str]:
    lines = [line for line in block("bash grpcurl-session").splitlines() if line.strip()]
    assert lines and all(line.startswith(GRPCURL + " ") for line in lines), (
        f"every command of the walkthrough calls {GRPCURL}, as pasted from the repository root")
    return lines


def grpcurl_binary() -> str:
    """The README's path when this checkout has its venv (as after scripts/setup.sh), else the
    copy beside the running interpreter (a CI venv elsewhere)."""
    exe = ROOT / GRPCURL
    if not exe.exists():
        exe = Path(sys.executable).parent / "grpcurl"
    assert exe.exists(), "grpcurl is missing: run scripts/setup_test.sh"
    return str(exe)


async def run_grpcurl(args: list[str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        grpcurl_binary(), *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


@pytest.fixture
async def live_server(tmp_path: Path):
    from transformers import AutoTokenizer

    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, str(smollm2_dir()))
    answer = '<tool_call>{"name": "submit", "arguments": {"answer": "42"}}</tool_call>'
    pool = BackendPool([ScriptedEngine(tokenizer, lambda session, turn: answer)])
    await pool.start()
    cfg = Config()
    cfg.server.port = 0
    cfg.server.state_dir = str(tmp_path / "state")
    server = Server(cfg, registry=HandlerRegistry.from_entry_points(), llm=pool)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1)
        await pool.close()


@pytest.mark.timeout(240)
async def test_readme_grpcurl_session_runs(live_server: Server) -> None:
    outputs = []
    for line in grpcurl_commands():
        args = shlex.split(line.replace(DEFAULT_ADDRESS, live_server.address))[1:]
        code, out = await run_grpcurl(args)
        assert code == 0, f"{line}\n{out}"
        outputs.append(out)
    listed, health, describe, submit, get, listing, status = outputs
    for service in ("rollout.v1.RolloutService", "grpc.health.v1.Health",
                    "grpc.reflection.v1alpha.ServerReflection", "rollout.v1.BackendService"):
        assert service in listed
    assert json.loads(health)["status"] == "SERVING"
    assert "rpc StreamRollouts ( stream .rollout.v1.StreamRolloutsRequest )" in describe
    frames = [json.loads(f) for f in re.findall(r"^\{.*?^\}", submit, re.S | re.M)]
    assert "accepted" in frames[0]
    assert frames[-1]["finished"]["state"] == "STATE_SUCCEEDED"
    assert frames[-1]["finished"]["reward"] == 1
    trajectory = next(f["trajectory"] for f in frames if "trajectory" in f)
    # proto3 JSON: reflection serves descriptors with their json_name, so grpcurl prints
    # lowerCamelCase field names (and accepts either spelling in -d)
    assert trajectory["turns"][0]["outputIds"], "the trajectory carries token ids"
    assert json.loads(get)["job"]["state"] == "STATE_SUCCEEDED"
    assert json.loads(listing)["jobs"][0]["jobId"] == "readme-1"
    assert {s["stage"] for s in json.loads(status)["stages"]} == {
        "STAGE_INIT", "STAGE_RUN", "STAGE_EVAL"}


@pytest.mark.timeout(120)
async def test_readme_error_example_is_true(live_server: Server) -> None:
    body = {"job": {"job_id": "bad-1", "environment": "nope", "task": {"q": 1}}}
    code, out = await run_grpcurl(["-plaintext", "-d", json.dumps(body), live_server.address,
                                   "rollout.v1.RolloutService/SubmitRollout"])
    assert code != 0
    documented = text_block("ERROR:")
    assert out.split() == documented.split(), out


@pytest.mark.timeout(120)
async def test_readme_trainer_snippet_collects_a_group(live_server: Server) -> None:
    namespace: dict[str, object] = {}
    exec(compile(block("python trainer-integration"), "README.md", "exec"), namespace)
    batch = await namespace["collect"](live_server.address, 4)  # type: ignore[operator]
    assert len(batch) == 4
    assert {f.group_id for f in batch} == {"prompt-17"}
    for flat in batch:
        assert flat.reward == 1.0
        assert len(flat.token_ids) == len(flat.loss_mask) == len(flat.logprobs)
        assert 0 < sum(flat.loss_mask) < len(flat.loss_mask)
    # The same call again (same client and job ids) returns the stored samples, not a hang.
    again = await asyncio.wait_for(namespace["collect"](live_server.address, 4), 30)  # type: ignore[operator]
    assert sorted(f.token_ids for f in again) == sorted(f.token_ids for f in batch)
