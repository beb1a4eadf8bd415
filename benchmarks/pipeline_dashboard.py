"""``rollout bench pipeline --dashboard N``: the server's throughput with the web dashboard
open on busy pages against the same server with none open, measured in one run.

One server process (loopback gRPC, SQLite, the ``noop`` environment) serves its dashboard on a
free port. Each row streams ``--jobs`` jobs end to end (submit -> trajectory -> ack) over a fresh
session, as (a) does. "Open" rows have N viewers attached for the whole row: each holds a live
page's event stream (the jobs page, which re-renders its table on every change of the jobs it
shows, and the overview, which also refreshes every 2 s) and loads that page in full every
2 s, as a person clicking around would. What the server does for a viewer is exactly what it
does for a browser: render pages and write the event stream; the viewers here read the stream
with an HTTP client instead of Chromium so that the bench's own CPU stays small. Rows alternate
(closed, open, closed, open) so drift on a shared machine hits both alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from rollout.benchmarks.server_process import BenchServer, cpu_s, stream_jobs

PAGES = ("/jobs", "/")
"""Busy pages the viewers keep open, in turn."""
RELOAD_S = 2.0


class Viewers:
    """N dashboard viewers for the duration of an ``async with`` block."""

    def __init__(self, base: str, n: int) -> None:
        self.base = base
        self.n = n
        self.events = 0
        self.loads = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._http: Any = None

    async def __aenter__(self) -> Viewers:
        import aiohttp

        self._http = aiohttp.ClientSession()
        for i in range(self.n):
            page = PAGES[i % len(PAGES)]
            live = "/live/jobs" if page == "/jobs" else "/live/overview"
            self._tasks.append(asyncio.ensure_future(self._follow(live)))
            self._tasks.append(asyncio.ensure_future(self._reload(page)))
        await asyncio.sleep(0.2)  # the streams are open before the row starts
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.close()

    async def _follow(self, path: str) -> None:
        async with self._http.get(self.base + path) as r:
            r.raise_for_status()
            async for line in r.content:
                if line.startswith(b"event: parts"):
                    self.events += 1

    async def _reload(self, path: str) -> None:
        while True:
            with contextlib.suppress(Exception):
                async with self._http.get(self.base + path) as r:
                    await r.read()
                    self.loads += 1
            await asyncio.sleep(RELOAD_S)


async def run(n: int, viewers: int) -> list[dict[str, Any]]:
    from rollout.client.aio import RolloutClient

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        async with BenchServer(tmp, dashboard=True) as srv, RolloutClient(srv.address) as client:
            base = f"http://127.0.0.1:{srv.dashboard_port}"
            k = 0
            for progress in (False, True):
                for open_ in (False, True, False, True):
                    k += 1
                    cpu0 = cpu_s(srv.pid)
                    if open_:
                        async with Viewers(base, viewers) as v:
                            t0 = time.monotonic()
                            res = await stream_jobs(client, n, f"d{k}-", progress=progress)
                            wall = time.monotonic() - t0
                        events, loads = v.events, v.loads
                    else:
                        res = await stream_jobs(client, n, f"d{k}-", progress=progress)
                        wall, events, loads = res.seconds, 0, 0
                    rows.append({"progress": progress, "open": open_, "rate": n / res.seconds,
                                 "cpu_ms": (cpu_s(srv.pid) - cpu0) / n * 1e3,
                                 "events": events, "loads": loads, "wall": wall})
    return rows


def report(rows: list[dict[str, Any]], n: int, viewers: int, console: Console) -> None:
    t = Table(title=f"pipeline throughput with the dashboard open: {n} no-op jobs per row, "
                    f"{viewers} viewer(s) on busy pages")
    for col in ("stage progress", "dashboard", "jobs/s", "server CPU ms/job",
                "server CPU % of a core", "live updates sent", "page loads"):
        t.add_column(col)
    for r in rows:
        t.add_row("on (batched)" if r["progress"] else "off",
                  f"open ({viewers})" if r["open"] else "closed", f"{r['rate']:,.0f}",
                  f"{r['cpu_ms']:.2f}", f"{r['cpu_ms'] * n / 1e3 / r['wall']:.0%}",
                  str(r["events"]) if r["open"] else "",
                  str(r["loads"]) if r["open"] else "")
    console.print(t)
    for progress in (False, True):
        closed = [r["rate"] for r in rows if r["progress"] is progress and not r["open"]]
        opened = [r["rate"] for r in rows if r["progress"] is progress and r["open"]]
        c, o = sum(closed) / len(closed), sum(opened) / len(opened)
        console.print(f"progress {'on' if progress else 'off'}: open / closed = {o / c:.2f} "
                      f"(mean of {len(opened)} rows each; closed rows differ by "
                      f"{abs(closed[0] - closed[1]) / c:.0%} between themselves)")


def main(n: int, viewers: int) -> int:
    console = Console()
    rows = asyncio.run(run(n, viewers))
    report(rows, n, viewers, console)
    return 0
