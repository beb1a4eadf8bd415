"""OpenCode's session-title request on its real request bodies, replayed through the real gateway
with the shipped preset's rules (no OpenCode install needed).

``data/opencode_title_requests.jsonl`` holds, as sent, the two chat-completions requests
OpenCode 1.18.33 made for one ``opencode run`` under the preset (its config, in bwrap, a
loopback stub answering): its title agent's request (system "You are a title generator...", the
task as a user message, no tools), then the main thread's (the preset's system prompt, its
tools). OpenCode sends both under the main model's name (the preset's ``small_model`` is the
job's model), so only the system prompt tells them apart: the title must be a chain of its own
and never trained, the main thread a trained chain. The live run is in
test_harness_opencode.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.harness import presets as harness_presets
from rollout.server.gateway import Gateway
from tests.runtime.doubles import smollm2_tokenizer
from tests.runtime.envs.harness_helpers import (
    chains_of,
    read_recording,
    replay_gateway,  # noqa: F401 (the `gateway` fixture)
    replay_recorded,
)

pytestmark = pytest.mark.timeout(120)

RECORDED = Path(__file__).parent / "data" / "opencode_title_requests.jsonl"
TITLE = "Whitespace word count fix"
DONE = "The fix is in place."


def recorded() -> list[dict[str, Any]]:
    return read_recording(RECORDED)


def test_the_recording_is_the_title_request_under_the_main_models_name() -> None:
    title, main = (r["body"] for r in recorded())
    assert title["model"] == main["model"] == "policy"
    assert title["messages"][0]["role"] == "system"
    assert title["messages"][0]["content"].startswith("You are a title generator")
    assert not title.get("tools") and main["tools"]
    assert title["stream"] and main["stream"]
    config = json.loads(harness_presets.render(
        harness_presets.load_preset("opencode")["files"]["{home}/.config/opencode/opencode.json"],
        {"model": "policy", "base_url": "", "api_key": "", "home": "", "max_tokens": "1"}))
    assert config["small_model"] == config["model"]


async def test_opencodes_title_request_is_an_untrained_chain_of_its_own(
        gateway: Gateway) -> None:
    capture = await replay_recorded(gateway, recorded(), [TITLE, DONE],
                                    harness_presets.resolve_side_calls("opencode"), {})
    assert capture.requests == 2
    assert chains_of(capture, smollm2_tokenizer()) == [
        (True, [(TITLE, False)]), (False, [(DONE, True)])]
