"""The live update's two races that a busy machine exposed: a stream that ended on a job's
terminal state before its trajectory was stored, and a reconnecting page that waited for events
it had already missed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rollout.runtime.types import JobState
from rollout.server.dashboard import live
from rollout.server.dashboard.pages import job_page_complete
from rollout.server.tenancy.auth import OPERATOR
from tests.server.dashboard.conftest import live_endpoint, open_live

pytestmark = pytest.mark.timeout(60)


def _ctx(state: JobState, traj: object | None) -> dict[str, object]:
    return {"job": SimpleNamespace(state=state), "traj": traj}


def test_a_job_page_ends_its_stream_only_with_the_trajectory() -> None:
    # The state turns terminal while the job is still live and its trajectory not yet stored:
    # ending the stream then left the page without the trajectory for good.
    assert not job_page_complete(_ctx(JobState.SUCCEEDED, None))
    assert not job_page_complete(_ctx(JobState.RUNNING, None))
    assert job_page_complete(_ctx(JobState.SUCCEEDED, object()))
    assert job_page_complete(_ctx(JobState.CANCELLED, object()))


async def test_a_page_that_connects_gets_the_current_state_before_any_event() -> None:
    """EventSource reconnects after a dropped stream; the events of the gap are gone from the
    page's point of view (a new watcher starts at the log's end), so the first update must be
    the whole live state, with no event at all."""
    hub = live.Hub()
    seen: list[live.Changes] = []

    async def render(changes: live.Changes) -> live.Update:
        seen.append(changes)
        return live.Update([("state", "FINISHED")], last=True)

    async with live_endpoint(hub, OPERATOR, render) as port:
        reader, writer = await open_live(port)
        body = await asyncio.wait_for(reader.readuntil(b"event: done"), 30)
        writer.close()
    assert b"event: parts" in body and b"FINISHED" in body
    assert b"event: done" in body
    assert seen and seen[0].many
