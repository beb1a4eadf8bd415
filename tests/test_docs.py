"""The environment of docs/writing-an-environment.md, run as written in a real server.

The tutorial's block is executed as a module, its handler registered the way an entry point
would be, and jobs go through a real gRPC server (store, stage pools, the real agent loop with
its tool-call parsing); only the model is the scripted testing policy.
"""

from __future__ import annotations

import asyncio
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout.client.sync import RolloutClientSync
from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.llm.scripted import ScriptedEngine
from rollout.v1 import trajectory_pb2
from tests.client.conftest import make_config
from tests.docs import block
from tests.runtime.chat_families import chatml_tokenizer
from tests.runtime.doubles import EngineClient

pytestmark = pytest.mark.timeout(60)


def _call(name: str, **arguments: str) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


SCRIPTS = {  # job id -> the model's reply per turn
    "right": [_call("length", text="stressed"), _call("submit", answer="desserts")],
    "wrong": [_call("submit", answer="stressed")],
    "bad-tool-call": [_call("length", txt="x"), _call("submit", answer="olleh")],
}


def tutorial_module() -> types.ModuleType:
    module = types.ModuleType("reverse_tutorial")
    exec(compile(block("python env-tutorial"), "docs/writing-an-environment.md", "exec"),
         module.__dict__)
    return module


class TutorialServer:
    def __init__(self, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        engine = ScriptedEngine(chatml_tokenizer(),
                                lambda sid, turn: SCRIPTS[sid][min(turn, len(SCRIPTS[sid]) - 1)])
        registry = HandlerRegistry()
        registry.register("reverse", tutorial_module().ReverseHandler())
        self.server = Server(make_config(state_dir), registry=registry,
                             llm=EngineClient(engine))
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.1), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture
def tutorial_server(tmp_path: Path) -> Iterator[TutorialServer]:
    srv = TutorialServer(tmp_path / "state")
    yield srv
    srv.stop()


def _run(address: str, job_id: str, task: dict[str, Any]) -> Any:
    with RolloutClientSync(address) as client:
        for frame in client.submit_rollout({"job_id": job_id, "environment": "reverse",
                                            "task": task, "limits": {"max_turns": 3}}):
            if frame.WhichOneof("kind") == "trajectory":
                return frame.trajectory
    raise AssertionError(f"{job_id}: no trajectory")


def test_the_tutorial_environment_scores_a_reversal(tutorial_server: TutorialServer) -> None:
    right = _run(tutorial_server.address, "right", {"word": "stressed"})
    assert right.reward == 1.0
    assert right.termination_reason == trajectory_pb2.TERMINATION_REASON_SUBMITTED
    assert len(right.turns) == 2
    # the length tool's observation reached the model as tokens with loss mask 0
    first = right.turns[0]
    assert first.tool_calls == ["length"] and first.observation_ids
    assert set(first.loss_mask[-len(first.observation_ids):]) == {0}
    assert right.reward_components["submitted"] == 1.0

    wrong = _run(tutorial_server.address, "wrong", {"word": "stressed"})
    assert wrong.reward == 0.0


def test_a_bad_tool_call_is_an_observation_the_model_can_fix(
        tutorial_server: TutorialServer) -> None:
    traj = _run(tutorial_server.address, "bad-tool-call", {"word": "hello"})
    assert traj.reward == 1.0 and len(traj.turns) == 2


def test_the_tutorial_refuses_a_bad_task_at_submit(tutorial_server: TutorialServer) -> None:
    from rollout.client.errors import RolloutError

    with pytest.raises(RolloutError) as info:
        _run(tutorial_server.address, "no-word", {"letters": "abc"})
    assert info.value.reason == "INVALID_TASK" and info.value.field == "task.word"


COMING = {"model-gateway.md", "bring-your-own-agent.md", "failures.md", "grading.md",
          "training.md", "dashboard.md"}
"""Guides the README's list already names while they are being written."""


def test_links_between_the_guides_resolve() -> None:
    import re

    from tests.docs import doc_files

    broken = []
    for path in doc_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or (path.parent / target).exists():
                continue
            if path.name == "README.md" and Path(target).name in COMING:
                continue
            broken.append(f"{path.name}: {target}")
    assert not broken, broken
