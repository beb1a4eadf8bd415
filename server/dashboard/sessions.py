"""Who is looking at the dashboard: the gRPC port's bearer tokens, carried by a session cookie.

A browser cannot put an ``Authorization`` header on a plain navigation, so the token is typed
once into the login form and exchanged for a random session id in a cookie that is
``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's page or form sends it),
``Path=/`` and ``Secure`` when the dashboard speaks TLS. The session maps to the token's
:class:`~rollout.server.tenancy.auth.Principal`, so tenancy is the gRPC port's: a client sees its
own
jobs, an admin (or the single ``auth_token``) all of them. Scripts may send the
``Authorization: Bearer`` header instead of the cookie.

CSRF: the dashboard changes nothing but the session itself. Its two POSTs (log in, log out)
must come from the dashboard's own origin (``Origin`` / ``Sec-Fetch-Site``), which also
stops a forged login that would sign the browser into someone else's session.

With no credentials configured the gRPC port is open and so is the dashboard, but a web page
elsewhere could still reach a loopback server through DNS rebinding; so an open dashboard
answers only requests whose ``Host`` names what it is bound to (:meth:`Sessions.host_allowed`):
its own address, loopback names only when it is bound to loopback, and only address literals
(never a DNS name) when it is bound to every interface. An open dashboard on a non-loopback
address is refused at start unless the operator allows it (``server.dashboard_allow_open``).

Sessions live in memory (a restart logs everyone out), expire after ``SESSION_TTL_S`` and are
bounded per identity (``MAX_SESSIONS_PER_IDENTITY``, the identity's oldest dropped first), so a
token holder logging in over and over logs out only its own other sessions.
"""

from __future__ import annotations

import ipaddress
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from rollout.server.api import errors
from rollout.server.tenancy.auth import OPERATOR, Authenticator, Principal, identity_of

COOKIE = "rollout_dashboard"
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS_PER_IDENTITY = 32
"""Log-in sessions one identity (a client id, or the operator's token) may hold."""
_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def is_loopback(host: str) -> bool:
    if host.strip("[]") in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Session:
    principal: Principal
    expires: float


class Sessions:
    """Login sessions and the checks every request goes through."""

    def __init__(self, authenticator: Authenticator, listen_host: str, *, secure: bool) -> None:
        self.authenticator = authenticator
        self.secure = secure
        self._listen_host = listen_host
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    @property
    def open(self) -> bool:
        """No credentials configured: everyone is the operator (as on the gRPC port)."""
        return not self.authenticator.enabled

    def check_token(self, token: str) -> Principal:
        """The principal of a bearer token; raises ``errors.Unauthenticated``."""
        return self.authenticator.authenticate({"authorization": f"Bearer {token}"}, {})

    def start(self, principal: Principal) -> str:
        sid = secrets.token_urlsafe(32)
        now = time.monotonic()
        for old in [k for k, v in self._sessions.items() if v.expires < now]:
            del self._sessions[old]
        who = identity_of(principal)
        mine = [k for k, v in self._sessions.items() if identity_of(v.principal) == who]
        for old in mine[:max(0, len(mine) - MAX_SESSIONS_PER_IDENTITY + 1)]:
            del self._sessions[old]  # its own oldest: never another identity's
        self._sessions[sid] = Session(principal, now + SESSION_TTL_S)
        return sid

    def end(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def principal(self, request: web.Request) -> Principal | None:
        """The request's principal, or None when it carries no valid credential."""
        if self.open:
            return OPERATOR
        header = request.headers.get("Authorization", "")
        if header:
            try:
                return self.authenticator.authenticate({"authorization": header}, {})
            except errors.Unauthenticated:
                return None
        sid = request.cookies.get(COOKIE, "")
        session = self._sessions.get(sid) if sid else None
        if session is None:
            return None
        if session.expires < time.monotonic():
            self._sessions.pop(sid, None)
            return None
        return session.principal

    def host_allowed(self, request: web.Request) -> bool:
        """An open dashboard answers a ``Host`` that names what it is bound to (DNS
        rebinding): its own address; loopback names too when bound to loopback; any address
        literal, but no DNS name, when bound to every interface."""
        if not self.open:
            return True
        host = request.host
        if host.startswith("["):  # [::1]:8080
            host = host[:host.find("]") + 1]
        elif host.count(":") == 1:
            host = host.rsplit(":", 1)[0]
        bare, listen = host.strip("[]"), self._listen_host.strip("[]")
        if bare == listen:
            return True
        if listen in _WILDCARDS:
            try:
                ipaddress.ip_address(bare)
                return True
            except ValueError:
                return host == "localhost"
        return is_loopback(listen) and host in _LOOPBACK_NAMES

    @staticmethod
    def same_origin(request: web.Request) -> bool:
        """Whether a state-changing request comes from the dashboard's own pages."""
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            return False
        origin = request.headers.get("Origin")
        if origin is None:
            # Browsers send Origin on every POST; a client without one is not a browser that
            # another site could drive (and has to know a token to get anywhere).
            return True
        return origin == f"{request.scheme}://{request.host}"

    def set_cookie(self, response: web.StreamResponse, sid: str) -> None:
        response.set_cookie(COOKIE, sid, max_age=int(SESSION_TTL_S), path="/", httponly=True,
                            samesite="Strict", secure=self.secure)

    @staticmethod
    def clear_cookie(response: web.StreamResponse) -> None:
        response.del_cookie(COOKIE, path="/")
