"""A node agent (what a Ray worker runs) gives harness jobs its own gateway, on its node: the
lease's socket is under the node's state directory, and the RUN reply carries the segments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout.runtime.types import JobSpec, Limits, SamplingParams, SegmentReason, Stage
from rollout.server.cluster.agent import AgentSpec, NodeAgent
from rollout.server.config import load_config
from rollout.server.gateway.service import MAX_SOCKET_PATH
from tests.server.gateway.test_through_server import REPLIES

pytestmark = pytest.mark.timeout(120)


async def test_harness_job_on_a_node_agent_uses_the_nodes_gateway(tmp_path: Path) -> None:
    script = tmp_path / "script.jsonl"
    script.write_text(json.dumps({"job_id": "n1", "messages": REPLIES}) + "\n")
    toml = tmp_path / "server.toml"
    toml.write_text(f'[[llm.backends]]\nkind = "scripted"\nfile = "{script}"\n')
    cfg = load_config(toml, [f"server.state_dir={tmp_path / 'server'}"], environ={})
    state = tmp_path / "node-0"
    agent = NodeAgent(AgentSpec(
        name="node-0", config=cfg, state_dir=str(state), slots=2,
        handlers={"fake-harness": "tests.server.gateway.test_through_server:InProcessHarness"}))
    try:
        job = JobSpec("n1", "fake-harness", {}, sampling=SamplingParams(seed=3),
                      limits=Limits(max_turns=8))
        for stage in (Stage.INIT, Stage.RUN):
            reply = await agent.run_stage(job, stage, 60.0)
            assert reply.result.error is None, reply.result.error
        assert reply.outcome is not None
        assert [s.reason for s in reply.outcome.segments] == [
            SegmentReason.FIRST, SegmentReason.HISTORY_REWRITTEN]
        assert len(reply.outcome.turns) == 3
        handler = agent.registry.get("fake-harness")
        socket = Path(handler.leases[0].socket_path)  # type: ignore[attr-defined]
        assert not socket.exists()  # closed with its lease
        own = state.resolve() / "gateway"
        if len(str(own)) + 22 <= MAX_SOCKET_PATH:
            assert socket.parent == own
        else:  # too long for a socket address: a private directory of the node's agent
            assert socket.parent.name.startswith("rollout-gw-")
    finally:
        await agent.close()
