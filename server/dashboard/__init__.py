"""The web dashboard (``rollout serve --dashboard-port N``), served from the server process.

aiohttp on the server's event loop, next to gRPC: pages read the scheduler and the store the
way the servicer does, and live pages follow the delivery's events (``live.py``). Pages are
rendered on the server with Jinja2; one small script (``static/dashboard.js``, no build step,
nothing from a network) applies the live updates. Login and tenancy: ``sessions.py``.

Every response carries a Content-Security-Policy that allows scripts and styles from the
dashboard's own files only, so even markup that escaped the templates could not run a script.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import jinja2
from aiohttp import web

from rollout.server.dashboard import live
from rollout.server.dashboard.pages import PRINCIPAL, Pages
from rollout.server.dashboard.sessions import Sessions, is_loopback
from rollout.server.gateway import connections
from rollout.server.scheduler import Scheduler
from rollout.server.startup import StartupError
from rollout.server.tenancy.auth import Authenticator, owner_of

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
PAGES = web.AppKey("pages", Pages)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def _fmt_s(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _fmt_time(epoch: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) if epoch else ""


def template_env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["secs"] = _fmt_s
    env.filters["when"] = _fmt_time
    env.globals["owner_of"] = owner_of
    return env


class Dashboard:
    """The dashboard's HTTP server. ``await start(host, port)`` returns the bound port."""

    def __init__(self, scheduler: Scheduler, authenticator: Authenticator, *,
                 tls_cert_file: str = "", tls_key_file: str = "",
                 min_interval_s: float = 0.25, allow_open: bool = False) -> None:
        self.scheduler = scheduler
        self.hub = live.Hub(scheduler.delivery.observe)
        self._tls = (tls_cert_file, tls_key_file) if tls_cert_file and tls_key_file else None
        self._authenticator = authenticator
        self._min_interval_s = min_interval_s
        self._allow_open = allow_open
        """Serve without credentials on a non-loopback address (``server.dashboard_allow_open``)."""
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.url = ""
        self.sessions: Sessions | None = None

    async def start(self, host: str, port: int) -> int:
        if not self._authenticator.enabled and not is_loopback(host) and not self._allow_open:
            raise StartupError(
                grpc.StatusCode.FAILED_PRECONDITION, "BAD_CONFIG",
                f"the dashboard would serve every job without a log-in on {host!r}, which is "
                "not a loopback address: configure tokens (server.auth_token or "
                "server.clients), listen on 127.0.0.1, or set server.dashboard_allow_open = "
                "true if the network is trusted", "server.dashboard_allow_open")
        self.sessions = Sessions(self._authenticator, host, secure=self._tls is not None)
        pages = Pages(self.scheduler, template_env(), self.hub,
                      min_interval_s=self._min_interval_s)
        app = connections.guard(web.Application(middlewares=[self._guard]))
        app[PAGES] = pages
        app.router.add_get("/login", self._login_form)
        app.router.add_post("/login", self._login)
        app.router.add_post("/logout", self._logout)
        app.router.add_static("/static", HERE / "static", show_index=False)
        app.router.add_get("/", pages.overview)
        app.router.add_get("/jobs", pages.jobs)
        app.router.add_get("/jobs/{job_id}", pages.job)
        app.router.add_get("/groups/{group_id}", pages.group)
        app.router.add_get("/live/overview", pages.overview_live)
        app.router.add_get("/live/jobs", pages.jobs_live)
        app.router.add_get("/live/job/{job_id}", pages.job_live)
        app.router.add_get("/live/group/{group_id}", pages.group_live)
        ctx = None
        if self._tls is not None:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(*self._tls)
        # Live pages end on their own when the hub closes; a short timeout is plenty.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = connections.tcp_site(runner, host, port, "dashboard", connections.DASHBOARD_LIMITS,
                                    ssl_context=ctx)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{'https' if ctx else 'http'}://{shown}:{self.port}/"
        return self.port

    async def stop(self) -> None:
        self.hub.close()
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
            self._runner = None

    # -- every request ----------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        sessions = self.sessions
        assert sessions is not None
        if not sessions.host_allowed(request):
            return self._headers(web.Response(
                status=421, text="this dashboard answers loopback addresses only while the "
                "server has no credentials; open it at 127.0.0.1 or configure a token"))
        public = request.path in ("/login", "/logout") or request.path.startswith("/static/")
        principal = sessions.principal(request)
        if principal is None and not public:
            if request.path.startswith("/live/") or request.method != "GET":
                response: web.StreamResponse = web.Response(
                    status=401, text="log in to the dashboard first (a token from the "
                    "server's configuration)")
            else:
                response = self._login_page(request, status=401,
                                            next_url=request.path_qs)
            return self._headers(response)
        assert principal is not None or public
        if principal is not None:
            request[PRINCIPAL] = principal
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if exc.status == 404 and principal is not None:
                response = request.app[PAGES].page(request, "error.html", status=404,
                                                     message=exc.text or "not found")
            else:
                raise self._headers(exc) from None
        return self._headers(response)

    @staticmethod
    def _headers(response: Any) -> Any:
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"  # no-referrer would send Origin: null
        response.headers["X-Frame-Options"] = "DENY"
        if "Cache-Control" not in response.headers:
            response.headers["Cache-Control"] = "no-store"
        return response

    # -- log in / out -----------------------------------------------------------------------

    def _login_page(self, request: web.Request, *, status: int = 200, error: str = "",
                    next_url: str = "/") -> web.Response:
        html = template_env().get_template("login.html").render(
            error=error, next_url=_local(next_url), principal=None)
        return web.Response(text=html, status=status, content_type="text/html")

    async def _login_form(self, request: web.Request) -> web.StreamResponse:
        return self._login_page(request, next_url=request.query.get("next", "/"))

    async def _login(self, request: web.Request) -> web.StreamResponse:
        sessions = self.sessions
        assert sessions is not None
        if not sessions.same_origin(request):
            return web.Response(status=403, text="cross-site login refused")
        form = await request.post()
        next_url = _local(str(form.get("next", "/")))
        if sessions.open:
            return _see_other(next_url)
        try:
            principal = sessions.check_token(str(form.get("token", "")))
        except Exception:
            return self._login_page(request, status=401, error="that token is not valid here",
                                    next_url=next_url)
        response = _see_other(next_url)
        sessions.set_cookie(response, sessions.start(principal))
        return response

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        sessions = self.sessions
        assert sessions is not None
        if not sessions.same_origin(request):
            return web.Response(status=403, text="cross-site logout refused")
        sid = request.cookies.get("rollout_dashboard", "")
        if sid:
            sessions.end(sid)
        response = _see_other("/login")
        sessions.clear_cookie(response)
        return response


def _local(url: str) -> str:
    """A redirect target on this dashboard only (no open redirect to another site)."""
    if not url.startswith("/") or url.startswith("//") or "\\" in url:
        return "/"
    return quote(url, safe="/?&=%-_.~:@!$'()*+,;")


def _see_other(url: str) -> web.Response:
    return web.Response(status=303, headers={"Location": url})
