"""``rollout jobs show ID --text``: the trajectory as text in the terminal, decoded by the
server (the client has no model), and GetJob's include_text behind it."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.entrypoints import job_commands as cli_commands
from tests.client.conftest import ServerHarness
from tests.runtime.doubles import smollm2_tokenizer
from tests.server.dashboard.conftest import ALICE, BOB, DashServer, call

pytestmark = pytest.mark.timeout(120)

HOSTILE = "plain \x1b[31mred\x1b[0m and [bold]markup[/bold]"


async def run_show(dash: DashServer, token: str, job_id: str, text: bool) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=200, color_system=None, force_terminal=False)
    args = argparse.Namespace(jobs_command="show", job_id=job_id, text=text)
    settings = argparse.Namespace(address=dash.address, token=token)
    assert await cli_commands.jobs(args, settings, console) == 0
    return buf.getvalue()


async def test_show_text_prints_each_turn_decoded(dash: DashServer) -> None:
    bash = call("bash", command="echo $((6*7))")
    await dash.run(ALICE, dash.spec("cli-1", [bash, HOSTILE]))
    async with RolloutClient(dash.address, token=ALICE) as client:
        resp = await client.get_job("cli-1", include_text=True)
    tok = smollm2_tokenizer()
    assert len(resp.text) == len(resp.trajectory.turns) == 2
    for turn, text in zip(resp.trajectory.turns, resp.text, strict=True):
        # One piece per id, and the pieces join to what the tokenizer decodes.
        assert len(text.output) == len(turn.output_ids)
        assert len(text.prompt) == len(turn.prompt_ids)
        assert len(text.observation) == len(turn.observation_ids)
        assert "".join(text.output) == tok.decode(list(turn.output_ids),
                                                  skip_special_tokens=False)

    out = await run_show(dash, ALICE, "cli-1", text=True)
    assert "turn 1 · policy version 3" in out and "turn 2 · policy version 3" in out
    assert "echo $((6*7))" in out
    assert "ended by NO_TOOL_CALL" in out and "2 turn(s)" in out
    # The hostile reply is printed as text: escape codes shown escaped, markup left alone.
    assert "\x1b" not in out
    assert "plain \\x1b[31mred\\x1b[0m and [bold]markup[/bold]" in out

    ids = await run_show(dash, ALICE, "cli-1", text=False)
    first = resp.trajectory.turns[0]
    assert " ".join(str(i) for i in first.output_ids[:5]) in ids
    assert "echo $((6*7))" not in ids


async def test_show_is_scoped_to_the_caller(dash: DashServer) -> None:
    await dash.run(ALICE, dash.spec("cli-a", [call("submit", answer="42")]))
    with pytest.raises(RolloutError) as err:
        await run_show(dash, BOB, "cli-a", text=True)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED


async def test_include_text_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    h = ServerHarness(tmp_path / "state")  # environments only, no LLM backend
    await h.start()
    try:
        async with RolloutClient(h.address) as client:
            async for _ in client.submit_rollout({"job_id": "no-tok", "environment": "scripted",
                                                  "task": {"reward": 1.0}}):
                pass
            assert (await client.get_job("no-tok", include_trajectory=True)).trajectory.turns \
                is not None
            with pytest.raises(RolloutError) as err:
                await client.get_job("no-tok", include_text=True)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.reason == "NO_TOKENIZER"
    finally:
        await h.stop()
