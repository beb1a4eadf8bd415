"""The dashboard's pages: overview, jobs, a job (with its trajectory), a group.

Each page is server-rendered HTML (Jinja2, autoescaped: model text is data, never markup) and
its live parts are the same templates rendered again for the page's event stream
(``server/dashboard/live.py``). Every read is scoped to the viewer: a tenant lists, opens and
follows only its own jobs, and another tenant's job or group answers exactly as one that does not
exist (404), as the gRPC port answers PERMISSION_DENIED for both.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web

from rollout.runtime.types import JobState, TerminationReason, Trajectory
from rollout.server.api import proto_convert
from rollout.server.api.token_text import TurnPieces, trajectory_pieces
from rollout.server.dashboard import live, trajectory_view
from rollout.server.scheduler import Scheduler
from rollout.server.store import JobRecord
from rollout.server.tenancy import ownership
from rollout.server.tenancy.auth import Principal, owner_of
from rollout.server.tenancy.tenant_status import OwnerCounts

PRINCIPAL = web.RequestKey("principal", Principal)
PAGE_SIZE = 50
SCAN_LIMIT = 2000
"""Jobs a filtered jobs page reads at most to fill itself (environment and termination are
not indexed): a sparse filter gives a short page with a link to scan further."""
TRAJECTORY_SCAN_LIMIT = 200
"""Trajectories a termination-filtered jobs page reads at most (each is a store read and a
decode): past it the page is short and links on, like ``SCAN_LIMIT``."""
SCANS_AT_ONCE = 1
"""Filtered scans running at once, all viewers together: the store has one reader thread, so
scans queue behind each other here instead of in front of gRPC's reads there."""
GROUP_LIMIT = 256
TEXT_CACHE = 16
"""Decoded trajectories kept (a job page, its reloads and its live update share one)."""
STATES = [s.name for s in JobState]
TERMINATIONS = [t.name for t in TerminationReason]


@dataclass(frozen=True)
class JobFilter:
    state: str = ""
    environment: str = ""
    group: str = ""
    client: str = ""
    termination: str = ""
    page_token: str = ""

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> JobFilter:
        f = cls(**{k: query.get(k, "").strip()[:128] for k in
                   ("state", "environment", "group", "client", "termination", "page_token")})
        if f.state and f.state not in STATES:
            raise web.HTTPBadRequest(text=f"state must be one of {', '.join(STATES)}")
        if f.termination and f.termination not in TERMINATIONS:
            raise web.HTTPBadRequest(
                text=f"termination must be one of {', '.join(TERMINATIONS)}")
        if f.page_token and not f.page_token.isdigit():
            raise web.HTTPBadRequest(text="page_token is not one this dashboard issued")
        for name in ("group", "client"):
            value = getattr(f, name)
            if value and not proto_convert.ID_RE.fullmatch(value):
                raise web.HTTPBadRequest(text=f"{name} is not a valid id")
        return f

    def query(self, **changes: str) -> str:
        values = {**self.__dict__, **changes}
        return urlencode({k: v for k, v in values.items() if v})


class Pages:
    """Page handlers over one scheduler; ``principal`` comes from the request (middleware)."""

    def __init__(self, scheduler: Scheduler, env: jinja2.Environment, hub: live.Hub, *,
                 min_interval_s: float) -> None:
        self.scheduler = scheduler
        self.env = env
        self.hub = hub
        self.min_interval_s = min_interval_s
        self._owner_counts = OwnerCounts(scheduler.store, self._live_state)
        self._texts: OrderedDict[str, list[TurnPieces]] = OrderedDict()
        self._scans = asyncio.Semaphore(SCANS_AT_ONCE)

    def _live_state(self, job_id: str) -> JobState | None:
        job = self.scheduler.jobs.get(job_id)
        return job.state if job is not None else None

    # -- helpers ----------------------------------------------------------------------------

    def render(self, name: str, **ctx: Any) -> str:
        return self.env.get_template(name).render(**ctx)

    def page(self, request: web.Request, name: str, status: int = 200,
             **ctx: Any) -> web.Response:
        principal: Principal = request[PRINCIPAL]
        html = self.render(name, principal=principal, **ctx)
        return web.Response(text=html, status=status, content_type="text/html")

    @staticmethod
    def tenant(principal: Principal) -> str | None:
        """The client id a principal's job lists are confined to (None: sees every job);
        one meaning with gRPC (``server/tenancy/ownership.py``)."""
        return ownership.job_scope(principal)

    async def visible_job(self, principal: Principal, job_id: str) -> JobRecord:
        if not proto_convert.ID_RE.fullmatch(job_id):
            raise web.HTTPNotFound(text="no such job")
        rec = await self.scheduler.get(job_id, history=True)
        if rec is None or not ownership.sees_job(principal, rec.client_id):
            # The same answer for "missing" and "someone else's": ids cannot be probed.
            raise web.HTTPNotFound(text=f"no job {job_id!r} is visible to you")
        return rec

    @property
    def tokenizer(self) -> Any:
        return getattr(self.scheduler.llm, "tokenizer", None)

    async def pieces(self, job_id: str, traj: Trajectory) -> list[TurnPieces] | None:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        cached = self._texts.get(job_id)
        if cached is None:
            cached = await asyncio.to_thread(trajectory_pieces, tokenizer, traj)
            self._texts[job_id] = cached
            while len(self._texts) > TEXT_CACHE:
                self._texts.popitem(last=False)
        return cached

    # -- overview ---------------------------------------------------------------------------

    async def overview_ctx(self, principal: Principal) -> dict[str, Any]:
        st = self.scheduler.status()
        tenant = None if ownership.sees_server_figures(principal) else principal.client_id
        if tenant is not None:
            by_state = {s.name: n for s, n in (await self._owner_counts.get(tenant)).items()}
        else:
            by_state = {s.name: n for s, n in st.jobs_by_state.items()}
        ctx: dict[str, Any] = {
            "stages": st.stages, "by_state": by_state, "pending": st.pending,
            "max_pending": st.max_pending, "uptime_s": st.uptime_s,
            "window_s": st.window_s, "environments": self.scheduler.registry.names(),
            "tenant": tenant, "terminations": {}, "nodes": [], "backends": []}
        if tenant is None:  # how other tenants' work runs is an admin's business
            ctx["terminations"] = {r.name: n for r, n in st.jobs_by_termination.items()}
            ctx["nodes"] = self.scheduler.nodes.status()
            backends = getattr(self.scheduler.llm, "backends", None)
            ctx["backends"] = backends() if callable(backends) else []
            ctx["sessions"] = st.sessions
        return ctx

    async def overview(self, request: web.Request) -> web.Response:
        ctx = await self.overview_ctx(request[PRINCIPAL])
        return self.page(request, "overview.html", live="/live/overview", **ctx)

    async def overview_live(self, request: web.Request) -> web.StreamResponse:
        principal = request[PRINCIPAL]

        async def render(_: live.Changes) -> live.Update:
            ctx = await self.overview_ctx(principal)
            return live.Update([("overview-live", self.render("overview_live.html", **ctx))])

        return await live.stream(request, self.hub, live.Watcher(self.hub, principal), render,
                                 min_interval_s=max(self.min_interval_s, 1.0), refresh_s=2.0)

    # -- jobs -------------------------------------------------------------------------------

    async def list_jobs(self, principal: Principal, f: JobFilter
                        ) -> tuple[list[JobRecord], str, int]:
        """One page of jobs matching ``f``: (jobs, next page token, rows scanned). Filters the
        store cannot answer (environment, termination) are applied to whole store pages, so a
        page holds at least ``PAGE_SIZE`` jobs (fewer at the end or past ``SCAN_LIMIT`` rows)
        and never skips one."""
        tenant = self.tenant(principal)
        if tenant is not None and f.client and f.client != tenant:
            return [], "", 0  # a tenant's view holds its own jobs only
        owner = tenant if tenant is not None else (f.client or None)
        state = JobState[f.state] if f.state else None
        if not (f.environment or f.termination):  # served by the store's indexes alone
            recs, token = await self.scheduler.list(
                page_size=PAGE_SIZE, page_token=f.page_token, state=state,
                group_id=f.group or None, owner=owner)
            return recs, token, len(recs)
        async with self._scans:
            return await self._scan(f, state, owner)

    async def _scan(self, f: JobFilter, state: JobState | None, owner: str | None
                    ) -> tuple[list[JobRecord], str, int]:
        token, out, scanned, read = f.page_token, [], 0, 0
        while True:
            recs, token = await self.scheduler.list(
                page_size=PAGE_SIZE, page_token=token, state=state,
                group_id=f.group or None, owner=owner)
            scanned += len(recs)
            for rec in recs:
                if f.environment and rec.spec.environment != f.environment:
                    continue
                if f.termination:
                    if not rec.state.terminal:
                        continue  # no trajectory yet: nothing to read
                    read += 1
                    traj = await self.scheduler.get_trajectory(rec.job_id)
                    if traj is None or traj.termination.name != f.termination:
                        continue
                out.append(rec)
            if (len(out) >= PAGE_SIZE or not token or scanned >= SCAN_LIMIT
                    or read >= TRAJECTORY_SCAN_LIMIT):
                return out, token, scanned

    async def jobs_ctx(self, principal: Principal, f: JobFilter) -> dict[str, Any]:
        jobs, token, scanned = await self.list_jobs(principal, f)
        return {"jobs": jobs, "filter": f, "next_token": token, "scanned": scanned,
                "states": STATES, "terminations": TERMINATIONS,
                "tenant": self.tenant(principal),
                "environments": self.scheduler.registry.names()}

    async def jobs(self, request: web.Request) -> web.Response:
        f = JobFilter.parse(request.query)
        ctx = await self.jobs_ctx(request[PRINCIPAL], f)
        return self.page(request, "jobs.html", live=f"/live/jobs?{f.query()}", **ctx)

    async def jobs_live(self, request: web.Request) -> web.StreamResponse:
        principal = request[PRINCIPAL]
        f = JobFilter.parse(request.query)

        async def render(_: live.Changes) -> live.Update:
            ctx = await self.jobs_ctx(principal, f)
            return live.Update([("jobs-live", self.render("jobs_table.html", **ctx))])

        return await live.stream(request, self.hub, live.Watcher(self.hub, principal), render,
                                 min_interval_s=max(self.min_interval_s, 1.0), refresh_s=0)

    # -- one job ----------------------------------------------------------------------------

    async def job_ctx(self, principal: Principal, job_id: str) -> dict[str, Any]:
        rec = await self.visible_job(principal, job_id)
        traj = await self.scheduler.get_trajectory(job_id) if rec.state.terminal else None
        ctx: dict[str, Any] = {"job": rec, "owner": owner_of(rec.client_id), "traj": traj,
                               "turns": None, "decoded": False,
                               "timeline": timeline(rec), "counters": {}}
        running = self.scheduler.jobs.get(job_id)
        if running is not None:  # read now, so a page opened mid-run shows them at once
            ctx["counters"] = live.turn_counters(running.last_turn)
        if traj is not None:
            pieces = await self.pieces(job_id, traj)
            ctx["turns"] = trajectory_view.build(traj, pieces)
            ctx["decoded"] = pieces is not None
            ctx["summary"] = trajectory_view.summary(traj)
        return ctx

    async def job(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job_id"]
        ctx = await self.job_ctx(request[PRINCIPAL], job_id)
        live_url = "" if ctx["job"].state.terminal else f"/live/job/{job_id}"
        return self.page(request, "job.html", live=live_url, **ctx)

    async def job_live(self, request: web.Request) -> web.StreamResponse:
        principal = request[PRINCIPAL]
        job_id = request.match_info["job_id"]
        await self.visible_job(principal, job_id)  # 404 before the stream opens
        watcher = live.Watcher(self.hub, principal, job_id=job_id)

        async def render(_: live.Changes) -> live.Update:
            ctx = await self.job_ctx(principal, job_id)
            parts = [("job-live", self.render("job_live.html", **ctx))]
            if not job_page_complete(ctx):
                return live.Update(parts)
            parts.append(("trajectory", self.render("trajectory.html", **ctx)))
            return live.Update(parts, last=True)

        return await live.stream(request, self.hub, watcher, render,
                                 min_interval_s=self.min_interval_s, refresh_s=0)

    # -- a group ----------------------------------------------------------------------------

    async def group_ctx(self, principal: Principal, group_id: str) -> dict[str, Any]:
        if not proto_convert.ID_RE.fullmatch(group_id):
            raise web.HTTPNotFound(text="no such group")
        recs, _ = await self.scheduler.list(page_size=GROUP_LIMIT, group_id=group_id)
        if not recs or not ownership.sees_group(
                principal, await ownership.group_owners(self.scheduler, group_id)):
            raise web.HTTPNotFound(text=f"no group {group_id!r} is visible to you")
        samples: list[dict[str, Any]] = []
        rewards: list[float] = []
        for rec in sorted(recs, key=lambda r: r.job_id):
            traj = await self.scheduler.get_trajectory(rec.job_id) if rec.state.terminal \
                else None
            final = ""
            if traj is not None and traj.turns:
                pieces = await self.pieces(rec.job_id, traj)
                if pieces is not None:
                    final = "".join(pieces[-1].output)
            samples.append({"job": rec, "summary": trajectory_view.summary(traj)
                            if traj is not None else None, "final": final})
            if traj is not None and rec.state is JobState.SUCCEEDED:
                rewards.append(traj.reward)
        return {"group_id": group_id, "samples": samples, "rewards": rewards,
                "all_tie": len(rewards) > 1 and len(set(rewards)) == 1}

    async def group(self, request: web.Request) -> web.Response:
        group_id = request.match_info["group_id"]
        ctx = await self.group_ctx(request[PRINCIPAL], group_id)
        return self.page(request, "group.html", live=f"/live/group/{group_id}", **ctx)

    async def group_live(self, request: web.Request) -> web.StreamResponse:
        principal = request[PRINCIPAL]
        group_id = request.match_info["group_id"]
        await self.group_ctx(principal, group_id)

        async def render(_: live.Changes) -> live.Update:
            ctx = await self.group_ctx(principal, group_id)
            return live.Update([("group-live", self.render("group_samples.html", **ctx))])

        return await live.stream(request, self.hub, live.Watcher(self.hub, principal), render,
                                 min_interval_s=max(self.min_interval_s, 1.0), refresh_s=0)


def timeline(rec: JobRecord) -> list[dict[str, Any]]:
    """The job's transitions with how long each lasted (the last one until now or its end)."""
    out = []
    hist = list(rec.history)
    for i, t in enumerate(hist):
        end = hist[i + 1].at if i + 1 < len(hist) else (
            t.at if rec.state.terminal else time.time())
        out.append({"at": t.at, "state": t.state.name,
                    "stage": t.stage.name if t.stage is not None else "",
                    "seconds": max(0.0, end - t.at)})
    return out


def job_page_complete(ctx: Mapping[str, Any]) -> bool:
    """Whether a job page's live stream has shown everything it ever will.

    A job's state turns terminal while it is still live, before the store has committed its
    trajectory (``get_trajectory`` answers None until then). A stream that ended on the state
    alone would end without the trajectory, and no later event would bring it: the page waits
    for the trajectory itself.
    """
    return bool(ctx["job"].state.terminal) and ctx.get("traj") is not None
