"""Who may see what: no token, a wrong token, another tenant, a forged form, a rebinding host,
and a browser that stops reading its live page."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout.server.dashboard import live
from rollout.server.dashboard.sessions import COOKIE
from rollout.server.tenancy.auth import OPERATOR, Principal
from tests.server.dashboard.conftest import (
    ALICE,
    BOB,
    OPS,
    DashServer,
    call,
    live_endpoint,
    login,
    open_live,
    screenshot,
)

pytestmark = pytest.mark.timeout(120)

SECRET = "alice-private-thought-7731"


async def test_requests_without_the_token_are_refused(dash: DashServer, browser: Any,
                                                      tmp_path: Path) -> None:
    await dash.run(ALICE, dash.spec("a-1", [call("submit", answer=SECRET)]))
    async with aiohttp.ClientSession() as http:
        for path in ("/", "/jobs", "/jobs/a-1", "/groups/g", "/live/overview",
                     "/live/job/a-1"):
            async with http.get(dash.url + path, allow_redirects=False) as r:
                assert r.status == 401, path
                assert SECRET not in await r.text()
        # A made-up session cookie and a wrong bearer token are no better.
        async with http.get(dash.url + "/jobs/a-1", cookies={COOKIE: "forged"}) as r:
            assert r.status == 401
        async with http.get(dash.url + "/jobs/a-1",
                            headers={"Authorization": "Bearer not-a-token-at-all"}) as r:
            assert r.status == 401
        async with http.post(dash.url + "/login", data={"token": "wrong-token-0123456789"},
                             allow_redirects=False) as r:
            assert r.status == 401
            assert COOKIE not in r.cookies
        # A form on another site cannot log a browser in (login CSRF), even with a good token.
        async with http.post(dash.url + "/login", data={"token": ALICE},
                             headers={"Origin": "http://evil.example"},
                             allow_redirects=False) as r:
            assert r.status == 403
            assert COOKIE not in r.cookies
        async with http.post(dash.url + "/login", data={"token": ALICE},
                             headers={"Sec-Fetch-Site": "cross-site"},
                             allow_redirects=False) as r:
            assert r.status == 403
        # The token in the header works (scripts), and only for the holder's jobs.
        async with http.get(dash.url + "/jobs/a-1",
                            headers={"Authorization": f"Bearer {ALICE}"}) as r:
            assert r.status == 200
            assert SECRET in await r.text()

    page = await browser.new_page()
    response = await page.goto(f"{dash.url}/jobs/a-1")
    assert response.status == 401
    assert await page.locator("#token").count() == 1
    assert SECRET not in await page.content()
    await page.fill("#token", "wrong-token-0123456789")
    await page.click("#login-submit")
    assert await page.inner_text("#login-error") == "that token is not valid here"
    await screenshot(page, tmp_path, "refused")
    # The right token leads back to the page asked for; the cookie is out of scripts' reach.
    await page.fill("#token", ALICE)
    await page.click("#login-submit")
    await page.wait_for_load_state()
    assert page.url == f"{dash.url}/jobs/a-1"
    assert SECRET in await page.inner_text("#turns")
    hub = dash.server.dashboard.hub
    assert not hub.observing  # a finished job's page follows nothing: no delivery observer
    (cookie,) = await page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert await page.evaluate("document.cookie") == ""
    # Logging out ends the session on the server, not only in this browser.
    await page.click("header.top button")
    await page.wait_for_load_state()
    async with aiohttp.ClientSession() as http:
        async with http.get(dash.url + "/", cookies={COOKIE: cookie["value"]}) as r:
            assert r.status == 401


async def test_a_tenant_cannot_open_another_tenants_job(dash: DashServer, browser: Any,
                                                        tmp_path: Path) -> None:
    await dash.run(ALICE, dash.spec("a-job", [call("submit", answer=SECRET)], group="a-grp"))
    await dash.run(BOB, dash.spec("b-job", [call("submit", answer="42")]))
    page = await login(await browser.new_page(), dash.url, BOB, "/jobs")
    assert [await r.get_attribute("data-job") for r in
            await page.locator("#jobs tr[data-job]").all()] == ["b-job"]
    # Filtering by Alice's client or group shows nothing either.
    for query in ("client=alice", "group=a-grp"):
        await page.goto(f"{dash.url}/jobs?{query}")
        assert await page.locator("#jobs tr[data-job]").count() == 0
    for path in ("/jobs/a-job", "/groups/a-grp", "/jobs/no-such-job"):
        response = await page.goto(dash.url + path)
        assert response.status == 404, path
        assert SECRET not in await page.content()
    # A missing job and Alice's job get the same answer, so ids cannot be probed.
    await page.goto(dash.url + "/jobs/a-job")
    taken = (await page.inner_text("#not-found")).replace("a-job", "X")
    await page.goto(dash.url + "/jobs/no-such-job")
    assert (await page.inner_text("#not-found")).replace("no-such-job", "X") == taken
    await screenshot(page, tmp_path, "tenant-refused")
    cookies = {c["name"]: c["value"] for c in await page.context.cookies()}
    async with aiohttp.ClientSession(cookies=cookies) as http:
        async with http.get(dash.url + "/live/job/a-job") as r:
            assert r.status == 404
    # Bob's overview counts his own job only. The admin sees the server-wide figures (both
    # jobs counted, the backends) but, as on the gRPC port, not another tenant's job.
    await page.goto(dash.url + "/")
    assert await page.inner_text("#job-counts [data-state=SUCCEEDED]") == "1"
    assert await page.locator("#backends").count() == 0  # the pool is an admin's business
    admin = await login(await browser.new_page(), dash.url, OPS, "/")
    assert await admin.inner_text("#job-counts [data-state=SUCCEEDED]") == "2"
    assert await admin.locator("#backends").count() == 1
    response = await admin.goto(dash.url + "/jobs/a-job")
    assert response.status == 404 and SECRET not in await admin.content()


async def test_an_open_dashboard_answers_loopback_names_only(tmp_path: Path) -> None:
    """No credentials configured (the loopback default): open like the gRPC port, but a page
    on another site reaching it through DNS rebinding carries a foreign Host and is refused."""
    from rollout.runtime.handler import HandlerRegistry
    from rollout.server.app import Server
    from tests.client.conftest import _no_sandbox, make_config

    server = await Server(make_config(tmp_path / "state", dashboard_port=0),
                          registry=HandlerRegistry(), sandbox_factory=_no_sandbox).start()
    try:
        assert server.dashboard is not None
        url = server.dashboard.url
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as r:
                assert r.status == 200
            async with http.get(url.replace("127.0.0.1", "localhost")) as r:
                assert r.status == 200
            async with http.get(url, headers={"Host": "rebind.evil.example"}) as r:
                assert r.status == 421
    finally:
        await server.stop(0.2)


async def test_a_page_reads_a_bounded_log_at_its_own_pace() -> None:
    hub = live.Hub()
    pages = [live.Watcher(hub, OPERATOR if i == 0 else Principal(f"tenant-{i}"))
             for i in range(live.MAX_WATCHERS)]
    assert all(hub.add(p) for p in pages[:-live.ADMIN_RESERVED])
    assert not hub.add(pages[-1])  # bounded number of pages, the admin's slots kept
    pages = pages[:-live.ADMIN_RESERVED]
    hub("c", "job-lost")  # pushed out of the log by what follows, before any page read it
    for _ in range(2 * live.LOG_SIZE):
        hub("c", "job-1")
    # An event costs an append; the pages are woken once, on the next loop iteration.
    assert not any(p._wake.is_set() for p in pages)
    await asyncio.sleep(0)
    assert all(p._wake.is_set() for p in pages)
    changes = pages[0].take()
    # job-lost is no longer in the log, so the page cannot know what it missed: "everything
    # changed" rather than {"job-1"}.
    assert changes.many and not changes.jobs
    assert not pages[0].take()
    for i in range(live.MAX_DIRTY + 1):
        hub("c", f"job-{i}")
    assert pages[0].take().many  # too many to take one by one
    hub("c", "job-1")
    hub("c", "job-1")
    assert pages[0].take().jobs == {"job-1"}


def test_a_page_sees_only_its_tenants_jobs() -> None:
    hub = live.Hub()
    alice = live.Watcher(hub, Principal("alice"), job_id="j")
    assert hub.add(alice)
    hub._log.extend([("bob", "j"), ("rpc:bob#j", "j"), ("rpc:alice#k", "k")])
    hub.seq += 3
    assert not alice.take()
    hub._log.append(("rpc:alice#j", "j"))
    hub.seq += 1
    assert alice.take().jobs == {"j"}
    admin = live.Watcher(hub, Principal("ops", frozenset({"admin"})))
    operator = live.Watcher(hub, OPERATOR)
    assert hub.add(admin) and hub.add(operator)
    hub._log.extend([("bob", "b"), ("ops", "o")])
    hub.seq += 2
    assert admin.take().jobs == {"o"}  # the admin role opens no other tenant's job
    assert operator.take().jobs == {"b", "o"}


async def test_a_browser_that_stops_reading_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A live page whose reader stalls costs the server one bounded write buffer until the
    write times out, then the stream is closed; nothing piles up for it meanwhile."""
    monkeypatch.setattr(live, "WRITE_TIMEOUT_S", 1.0)
    hub = live.Hub()
    renders = 0

    async def render(_: live.Changes) -> live.Update:
        nonlocal renders
        renders += 1
        return live.Update([("x", "y" * 256_000)])

    async with live_endpoint(hub, OPERATOR, render, refresh_s=0.01) as port:
        _, writer = await open_live(port)  # then never reads
        for _ in range(300):
            if hub.count == 0 and renders:
                break
            await asyncio.sleep(0.1)
        assert hub.count == 0, "the stalled stream is still open"
        stalled_after = renders
        await asyncio.sleep(0.5)
        assert renders == stalled_after  # and nothing is rendered for it any more
        writer.close()


async def test_with_tls_the_dashboard_speaks_https_and_its_cookie_is_secure(
        tmp_path: Path) -> None:
    import json
    import ssl

    from tests.client.conftest import ServerHarness
    from tests.server.dashboard.conftest import CLIENTS
    from tests.server.tls_certs import TestCA

    ca = TestCA()
    cert, key = ca.issue("rollout-server", ips=("127.0.0.1",), server=True).write(tmp_path,
                                                                                  "server")
    h = ServerHarness(tmp_path / "state", clients=json.dumps(CLIENTS), tls_cert_file=cert,
                      tls_key_file=key, dashboard_port=0)
    server = await h.start()
    try:
        assert server.dashboard is not None and server.dashboard.url.startswith("https://")
        url = server.dashboard.url.rstrip("/")
        trust = ssl.create_default_context(cadata=ca.pem.decode())
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/login", data={"token": ALICE}, ssl=trust,
                                 allow_redirects=False) as r:
                assert r.status == 303
                morsel = r.cookies[COOKIE]
                assert morsel["secure"] and morsel["httponly"]
                assert morsel["samesite"] == "Strict"
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port
                async with http.get(url.replace("https://", "http://") + "/login") as r:
                    await r.read()
    finally:
        await h.stop()
