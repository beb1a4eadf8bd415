"""The dashboard in a real headless Chromium: overview, a finished job's trajectory, a running
job's live page, a group, escaping of hostile model text."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from rollout.client.aio import RolloutClient
from rollout.server.dashboard.trajectory_view import shade
from tests.runtime.doubles import smollm2_tokenizer
from tests.server.dashboard.conftest import (
    ALICE,
    OPS,
    DashServer,
    call,
    login,
    pattern_logprob,
    screenshot,
)

pytestmark = pytest.mark.timeout(120)
expect = pytest.importorskip("playwright.async_api").expect

BASH = call("bash", command="echo $((6*7))")
SUBMIT = call("submit", answer="42")


async def test_overview_loads(dash: DashServer, browser: Any, tmp_path: Path) -> None:
    page = await login(await browser.new_page(), dash.url, OPS, "/")
    assert await page.title() == "overview · rollout dashboard"
    stages = await page.locator("#stages tbody tr").all_inner_texts()
    assert [s.split()[0] for s in stages] == ["INIT", "RUN", "EVAL"]
    assert (await page.inner_text("#stages tr[data-stage=EVAL] .completed")) == "0"
    await expect(page.locator("#live-dot")).to_have_class(re.compile(r"\bon\b"))
    await dash.run(ALICE, dash.spec("ov-1", [SUBMIT]))
    # The open page follows: the stage table and the job counts change without a reload.
    await expect(page.locator("#stages tr[data-stage=EVAL] .completed")).to_have_text(
        "1", timeout=30_000)
    await expect(page.locator("#job-counts [data-state=SUCCEEDED]")).to_have_text("1")
    backend = await page.inner_text("#backends tbody tr")
    assert "scripted-gated" in backend and "healthy" in backend
    assert backend.split("\t")[8].strip() == "3"  # the policy version column
    assert "(server)" in await page.inner_text("#nodes")
    await screenshot(page, tmp_path, "overview")


async def test_finished_job_shows_its_turns_as_text(dash: DashServer, browser: Any,
                                                    tmp_path: Path) -> None:
    await dash.run(ALICE, dash.spec("fin-1", [BASH, SUBMIT]))
    async with RolloutClient(dash.address, token=ALICE) as client:
        traj = (await client.get_job("fin-1", include_trajectory=True)).trajectory
    tok = smollm2_tokenizer()

    page = await login(await browser.new_page(), dash.url, ALICE, "/jobs/fin-1")
    assert await page.inner_text("#job-state") == "SUCCEEDED"
    assert await page.inner_text("#turn-count") == "2"
    assert await page.locator("article.turn").count() == 2
    assert await page.inner_text("#termination") == "SUBMITTED"
    assert (await page.inner_text("#traj-reward")).startswith("1.0000")
    for i, turn in enumerate(traj.turns):
        article = page.locator(f"article.turn[data-turn='{i}']")
        # Each segment's text is what the tokenizer decodes from the stored ids.
        assert await article.locator(".seg.output pre").inner_text() == tok.decode(
            list(turn.output_ids), skip_special_tokens=False)
        assert "policy version 3" in await article.locator("header").inner_text()
        ids = [int(x) for x in await article.locator(".seg.output .tok").evaluate_all(
            "els => els.map(e => e.dataset.id)")]
        assert ids == list(turn.output_ids)
        classes = await article.locator(".seg.output .tok").evaluate_all(
            "els => els.map(e => e.className)")
        assert classes == [f"tok m1 lp{shade(pattern_logprob(i, k))}"
                           for k in range(len(ids))]
    assert "echo $((6*7))" in await page.inner_text("article.turn[data-turn='0'] .seg.output")
    assert "42" in await page.inner_text("article.turn[data-turn='0'] .seg.observation")
    # Prompt and observation tokens carry loss mask 0, generated ones 1.
    assert await page.locator(".seg.prompt .tok.m1, .seg.observation .tok.m1").count() == 0
    assert await page.inner_text("#job-client") == "alice (SubmitRollout)"
    await screenshot(page, tmp_path, "job-page")
    await page.check("#raw-ids")
    assert "show-ids" in (await page.get_attribute("body", "class") or "")
    first = page.locator("article.turn[data-turn='0'] .seg.output .tok").first
    after = await first.evaluate("e => getComputedStyle(e, '::after').content")
    assert str(traj.turns[0].output_ids[0]) in after
    await screenshot(page, tmp_path, "job-page-raw-ids")


async def test_running_job_page_updates_as_it_runs(dash: DashServer, browser: Any,
                                                  tmp_path: Path) -> None:
    gates = [dash.engine.hold("run-1", t) for t in range(3)]
    dash.start(ALICE, dash.spec("run-1", [BASH, BASH, SUBMIT]))
    await asyncio.wait_for(dash.engine.reached[("run-1", 0)].wait(), 60)
    page = await login(await browser.new_page(), dash.url, ALICE, "/jobs/run-1")
    assert await page.inner_text("#job-state") == "RUNNING"
    assert await page.inner_text("#job-stage") == "RUN"
    assert await page.inner_text("#traj-pending")
    await page.evaluate("window.__sameDocument = true")
    assert dash.server.dashboard.hub.observing  # the open page follows the delivery's events
    await expect(page.locator("#live-dot")).to_have_class(re.compile(r"\bon\b"))

    gates[0].set()
    await expect(page.locator("#live-turns")).to_have_text("1", timeout=30_000)
    assert await page.inner_text("#job-state") == "RUNNING"
    gates[1].set()
    await expect(page.locator("#live-turns")).to_have_text("2", timeout=30_000)
    await screenshot(page, tmp_path, "job-running")
    # A page opened now (mid-run) shows the counters at once, before any further event.
    late = await login(await browser.new_page(), dash.url, ALICE, "/jobs/run-1")
    assert await late.inner_text("#live-turns") == "2"
    assert await late.inner_text("#live-tools") == "2"
    gates[2].set()
    await expect(page.locator("#job-state")).to_have_text("SUCCEEDED", timeout=60_000)
    await page.wait_for_selector("#turn-count")
    assert await page.inner_text("#turn-count") == "3"
    assert await page.evaluate("window.__sameDocument") is True  # updated in place
    # The page's stream ended with the job, and with it the delivery observer.
    for _ in range(100):
        if not dash.server.dashboard.hub.observing:
            break
        await asyncio.sleep(0.05)
    assert not dash.server.dashboard.hub.observing
    await screenshot(page, tmp_path, "job-running-finished")


async def test_group_page_shows_samples_side_by_side(dash: DashServer, browser: Any,
                                                     tmp_path: Path) -> None:
    scripts = {"g-1/0": [BASH, SUBMIT], "g-1/1": [SUBMIT],
               "g-1/2": [call("submit", answer="41")], "g-1/3": [BASH, call("submit",
                                                                         answer="48")]}
    gate = dash.engine.hold("g-1/3", 1)
    runs = [dash.start(ALICE, dash.spec(j, s, group="g-1")) for j, s in scripts.items()]
    await asyncio.wait_for(dash.engine.reached[("g-1/3", 1)].wait(), 60)
    page = await login(await browser.new_page(), dash.url, ALICE, "/groups/g-1")
    await expect(page.locator("#live-dot")).to_have_class(re.compile(r"\bon\b"))
    await expect(page.locator("article.sample .reward")).to_have_count(3, timeout=60_000)
    gate.set()  # the last sample finishes while the page is open
    await asyncio.gather(*runs)
    await expect(page.locator("article.sample .reward")).to_have_count(4, timeout=30_000)
    cards = page.locator("article.sample")
    assert await cards.count() == 4
    got = {}
    for i in range(4):
        card = cards.nth(i)
        got[await card.get_attribute("data-job")] = (
            await card.locator(".reward").inner_text(), await card.locator(".turns").inner_text())
    assert got == {"g-1/0": ("1.000", "2"), "g-1/1": ("1.000", "1"),
                   "g-1/2": ("0.000", "1"), "g-1/3": ("0.000", "2")}
    assert "rewards differ" in await page.inner_text("#group-summary")
    await screenshot(page, tmp_path, "group-page")


HOSTILE = ('<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
           '<b id="injected">bold?</b>')


async def test_hostile_model_text_is_shown_not_run(dash: DashServer, browser: Any,
                                                    tmp_path: Path) -> None:
    # Held before its only turn, so the trajectory reaches the open page through the live
    # update (innerHTML) as well as through a fresh load.
    gate = dash.engine.hold("xss-1", 0)
    dash.start(ALICE, dash.spec("xss-1", [HOSTILE]))
    await asyncio.wait_for(dash.engine.reached[("xss-1", 0)].wait(), 60)
    page = await login(await browser.new_page(), dash.url, ALICE, "/jobs/xss-1")
    await expect(page.locator("#live-dot")).to_have_class(re.compile(r"\bon\b"))
    gate.set()
    await page.wait_for_selector("#turn-count", timeout=60_000)

    async def check() -> None:
        assert await page.evaluate("window.__pwned") is None
        assert await page.locator("#injected").count() == 0
        assert await page.locator("#turns img, #turns script").count() == 0
        assert "<script>window.__pwned = 1</script>" in await page.inner_text("#turns")

    await check()
    await page.reload()
    await check()
    await screenshot(page, tmp_path, "hostile-text")


async def test_jobs_page_filters_and_follows(dash: DashServer, browser: Any,
                                             tmp_path: Path) -> None:
    await dash.run(ALICE, dash.spec("flt-ok", [SUBMIT]))
    await dash.run(ALICE, dash.spec("flt-text", ["the answer is 42"]))
    page = await login(await browser.new_page(), dash.url, ALICE,
                       "/jobs?termination=NO_TOOL_CALL")
    rows = page.locator("#jobs tbody tr[data-job]")
    assert [await r.get_attribute("data-job") for r in await rows.all()] == ["flt-text"]
    await page.goto(f"{dash.url}/jobs?state=SUCCEEDED&environment=math")
    assert {await r.get_attribute("data-job") for r in await rows.all()} == {"flt-ok",
                                                                             "flt-text"}
    # A job submitted while the page is open appears without a reload.
    gate = dash.engine.hold("flt-new", 0)
    await page.goto(f"{dash.url}/jobs")
    await expect(page.locator("#live-dot")).to_have_class(re.compile(r"\bon\b"))
    dash.start(ALICE, dash.spec("flt-new", [SUBMIT]))

    await page.wait_for_selector("#jobs tr[data-job='flt-new']", timeout=30_000)
    gate.set()
    await expect(page.locator("#jobs tr[data-job='flt-new'] .state")).to_have_text(
        "SUCCEEDED", timeout=60_000)
    await screenshot(page, tmp_path, "jobs")


async def test_a_cancelled_job_shows_why_and_what_it_produced(dash: DashServer, browser: Any,
                                                              tmp_path: Path) -> None:
    dash.engine.hold("cx-1", 1)
    task = dash.start(ALICE, dash.spec("cx-1", [BASH, SUBMIT]))
    await asyncio.wait_for(dash.engine.reached[("cx-1", 1)].wait(), 60)
    page = await login(await browser.new_page(), dash.url, ALICE, "/jobs/cx-1")
    await expect(page.locator("#live-dot")).to_have_class(re.compile(r"\bon\b"))
    async with RolloutClient(dash.address, token=ALICE) as client:
        assert await client.cancel(job_id="cx-1") == ["cx-1"]
    await expect(page.locator("#job-state")).to_have_text("CANCELLED", timeout=60_000)
    assert "CANCELLED" in await page.inner_text("#job-error")
    await page.wait_for_selector("#turn-count")
    assert await page.inner_text("#termination") == "CANCELLED"
    assert await page.inner_text("#turn-count") == "1"  # the turn RUN finished before it
    await screenshot(page, tmp_path, "job-cancelled")
    await asyncio.gather(task, return_exceptions=True)
