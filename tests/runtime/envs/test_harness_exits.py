"""The workspace is always graded: however a harness ends (non-zero exit, a signal, the
gateway refusing a request, the deadline), EVAL grades what it left and the exit is the
termination reason; only a harness that never made a request is the service's failure."""

from __future__ import annotations

from typing import Any

import pytest

from rollout.runtime.envs.harness.handler import HarnessHandler
from rollout.runtime.handler import HandlerError
from rollout.runtime.types import Limits, SamplingParams, TerminationReason
from rollout.server.pipeline.stages import _unfinished_run
from tests.runtime.envs.conftest import Rollout
from tests.runtime.envs.harness_helpers import GatewayRig, harness_task

pytestmark = pytest.mark.timeout(120)

# A harness that asks the model {requests} times, writes the right answer, then ends {how}.
HARNESS = r'''
import json, os, signal, sys, urllib.error, urllib.request
requests, how, pad = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def ask(n):
    # A later request may carry a long text (a harness that pastes a whole log).
    body = json.dumps({"model": "m", "messages": [
        {"role": "user", "content": f"What is 1 + 1? (try {n})" + " log" * (pad * n)}]}).encode()
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", body,
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as e:
        print("REFUSED", e.code, e.read().decode())
        return e.code
codes = [ask(n) for n in range(requests)]
with open("answer.txt", "w") as f:
    f.write("2")
if how == "signal":
    os.kill(os.getpid(), signal.SIGSEGV)
sys.exit(int(how))
'''
MATH = {"question": "What is 1 + 1?", "answer": "2", "tools": []}


def harness(requests: int, how: str, pad: int = 0) -> dict[str, Any]:
    return {"command": ["python", "{home}/h.py", str(requests), how, str(pad)],
            "files": {"{home}/h.py": HARNESS}}


@pytest.mark.parametrize(("requests", "how", "max_turns", "termination"), [
    (1, "0", 4, TerminationReason.SUBMITTED),
    (1, "3", 4, TerminationReason.HARNESS_ERROR),
    (1, "signal", 4, TerminationReason.HARNESS_ERROR),
    (2, "1", 1, TerminationReason.MAX_TURNS),  # the gateway refused the second request
])
async def test_a_harness_that_ends_any_way_is_graded(
        rollout: Rollout, gateway_rig: GatewayRig, requests: int, how: str, max_turns: int,
        termination: TerminationReason) -> None:
    task = harness_task("math", MATH, harness(requests, how))
    result = await rollout(HarnessHandler(), task, ["I think it is 2."] * requests,
                           gateway=gateway_rig.gateway,
                           limits=Limits(max_turns=max_turns, run_timeout_s=60))
    assert result.outcome.termination is termination, result.outcome.metadata
    # Not an unfinished RUN: the pipeline goes on to EVAL, and the job SUCCEEDS.
    assert _unfinished_run(result.outcome) is None
    assert result.reward.value == 1.0, result.reward.info
    assert result.ctx.state["harness.capture"].requests == min(requests, max_turns)


async def test_a_harness_whose_prompt_outgrows_the_budget_is_graded(
        rollout: Rollout, gateway_rig: GatewayRig) -> None:
    task = harness_task("math", MATH, harness(2, "1", pad=400))
    result = await rollout(HarnessHandler(), task, ["I think it is 2."] * 2,
                           gateway=gateway_rig.gateway,
                           limits=Limits(max_turns=4, run_timeout_s=60),
                           sampling=SamplingParams(total_token_budget=200))
    assert result.outcome.termination is TerminationReason.TOKEN_BUDGET
    assert "context_length_exceeded" in result.outcome.metadata["harness_log"]
    assert result.reward.value == 1.0


async def test_a_harness_that_never_starts_is_the_services_failure(
        rollout: Rollout, gateway_rig: GatewayRig) -> None:
    task = harness_task("math", MATH, harness(0, "2"))
    with pytest.raises(HandlerError) as info:
        await rollout(HarnessHandler(), task, [], gateway=gateway_rig.gateway,
                      limits=Limits(max_turns=4, run_timeout_s=60))
    assert info.value.reason == "HARNESS_NOT_STARTED"
