"""Small bounds of issue 31: OSError's reason, the retried-commit log line, stale gateway
sockets swept at start, and the dashboard's filtered scans bounded in cost."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rollout.runtime.types import JobState, Stage, TerminationReason
from rollout.server.dashboard import live, pages
from rollout.server.gateway import Gateway
from rollout.server.pipeline.stages import _handler_error, _upper_snake
from rollout.server.store.sqlite import Writer
from rollout.server.tenancy.auth import OPERATOR

pytestmark = pytest.mark.timeout(30)


def test_an_os_error_has_a_named_reason() -> None:
    err = _handler_error(OSError(errno.EMFILE, "Too many open files"), Stage.INIT)
    assert err.reason == "OS_ERROR" and "EMFILE" in err.message
    assert _upper_snake("OSError") == "OS_ERROR"
    assert _upper_snake("ValueError") == "VALUE_ERROR"
    assert _upper_snake("HTTPError") == "HTTP_ERROR"
    assert _handler_error(FileNotFoundError("x"), Stage.RUN).reason == "FILE_NOT_FOUND_ERROR"


class _FailingCommit:
    in_transaction = True

    def execute(self, sql: str, *args: Any) -> None:
        if sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")


def test_a_failed_commit_says_its_writes_are_retried_not_lost(
        caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        writer = Writer(":memory:", loop, 8)
        caplog.set_level(logging.ERROR)
        writer._apply(_FailingCommit(), [(lambda c: None, None)])  # type: ignore[arg-type]
    finally:
        loop.close()
    line = next(r.getMessage() for r in caplog.records if "commit failed" in r.getMessage())
    assert "lost" not in line and "written again" in line and "retry" in line


async def test_stale_gateway_sockets_are_swept_at_start(short_tmp: Path) -> None:
    root = short_tmp / "state" / "gateway"
    root.mkdir(parents=True)
    left = root / "0123456789abcdef.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(left))
    s.close()  # what a SIGKILLed server leaves: the file, nobody listening
    assert left.exists()
    gateway = await Gateway(short_tmp / "state").start()
    try:
        assert not left.exists()
    finally:
        await gateway.stop()


async def test_filtered_job_scans_are_bounded_and_one_at_a_time() -> None:
    reads = 0
    running = peak = 0
    recs = [SimpleNamespace(job_id=f"j{i}", state=JobState.SUCCEEDED,
                            spec=SimpleNamespace(environment="math")) for i in range(5000)]

    async def list_(page_size: int, page_token: str = "", **_: Any) -> tuple[list[Any], str]:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)
        running -= 1
        at = int(page_token or 0)
        nxt = at + page_size
        return recs[at:nxt], str(nxt) if nxt < len(recs) else ""

    async def get_trajectory(job_id: str) -> Any:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0)
        return SimpleNamespace(termination=TerminationReason.SUBMITTED)

    scheduler: Any = SimpleNamespace(store=None, list=list_, get_trajectory=get_trajectory,
                                     jobs={})
    view = pages.Pages(scheduler, None, live.Hub(), min_interval_s=0.0)  # type: ignore[arg-type]
    f = pages.JobFilter(termination="DEADLINE")  # matches nothing: the worst case
    results = await asyncio.gather(*(view.list_jobs(OPERATOR, f) for _ in range(8)))
    assert peak == 1  # eight viewers' scans ran one at a time
    assert reads <= 8 * (pages.TRAJECTORY_SCAN_LIMIT + pages.PAGE_SIZE)
    assert all(token for _, token, _ in results)  # each page links on to scan further
