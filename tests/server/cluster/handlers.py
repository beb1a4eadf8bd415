"""An I/O-bound environment for the cluster tests, importable on every Ray node.

``io``: INIT opens a real bubblewrap sandbox (when the node has a sandbox runtime and the task
asks, ``sandbox: true``) and starts its bash; RUN sleeps ``task["run_s"]`` seconds (a stand-in
for waiting on tools and the model) and runs ``echo`` through the sandbox's bash; EVAL rewards
1.0 when the echo came back. The outcome names the process that ran RUN (``pid``), so a test
can tell processes apart without trusting the node's own label. With ``gate_file``, RUN
reports a ``turn`` progress event and then waits until that file exists.
"""

from __future__ import annotations

import asyncio
import os

from rollout.runtime.handler import AgentHandler, HandlerError, JobContext, RunOutcome
from rollout.runtime.types import Reward, TerminationReason, Turn

_TURN = Turn(prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.5, -0.25])


class IoHandler(AgentHandler):
    name = "io"

    async def init(self, ctx: JobContext) -> None:
        if ctx.spec.task.get("sandbox"):
            sandbox = await ctx.open_sandbox()
            ctx.state["sandbox"] = sandbox

    async def run(self, ctx: JobContext) -> RunOutcome:
        gate = ctx.spec.task.get("gate_file")
        if gate:  # report a turn, then wait (across processes) until the test opens the gate
            ctx.progress("turn", {"turn": 1})
            while not os.path.exists(gate):
                await asyncio.sleep(0.02)
        await asyncio.sleep(float(ctx.spec.task.get("run_s", 0.0)))
        echoed = ""
        sandbox = ctx.state.get("sandbox")
        if sandbox is not None:
            bash = await sandbox.bash()
            echoed = (await bash.run(f"echo {ctx.spec.job_id}")).output.strip()
        return RunOutcome(turns=[_TURN], termination=TerminationReason.NO_TOOL_CALL,
                          metadata={"pid": str(os.getpid()), "echo": echoed})

    async def eval(self, ctx: JobContext) -> Reward:
        assert ctx.outcome is not None
        if ctx.spec.task.get("sandbox") and ctx.outcome.metadata["echo"] != ctx.spec.job_id:
            raise HandlerError("the sandbox's bash did not echo the job id", "NO_ECHO")
        return Reward(1.0)
