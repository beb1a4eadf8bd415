"""The node agent: what runs a node's share of the stage work, inside one Ray actor per node.

It owns the contexts of the jobs placed on its node (their sandboxes, tool processes, graders)
from INIT until the server releases them, runs one stage at a time per job, and answers with a
:class:`~rollout.server.cluster.node.StageReply` (plain data), so the server can build every
trajectory without reaching into the node. Nothing here imports Ray: the actor class that
wraps it lives in ``ray_backend.py``, and a test can drive an agent in-process.

The LLM client: each agent builds its own backend pool from the server's ``[llm]`` section.
vLLM backends are HTTP servers that every node reaches directly, so turns take one hop
(node -> vLLM) instead of two (node -> server -> vLLM) and the server process stays off the
token path, which is what lets the cluster scale past one machine's network and CPU. Stickiness
holds because a trajectory never leaves its node; the price is that least-loaded balancing is
per node rather than global, and that an in-process ``transformers`` backend is loaded once
per node (fine for a small CPU model, wasteful for a large one: use vLLM on a cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.runtime.agent_loop import SEED_KEY, TURNS_KEY
from rollout.runtime.gateway import SEGMENTS_KEY
from rollout.runtime.handler import AgentHandler, HandlerRegistry, JobContext
from rollout.runtime.types import InvalidArgument, JobError, JobSpec, Stage
from rollout.server.cluster.node import StageReply
from rollout.server.pipeline.stages import StageResult, release, run_stage

NODE_KEY = "rollout.node"
"""Trajectory metadata key naming the node that ran the job (remote nodes only)."""


@dataclass(frozen=True)
class AgentSpec:
    """How to build one node agent (sent to the node, so plain data only)."""

    name: str
    config: Any
    """The server's ``Config``: its ``[sandbox]`` and ``[llm]`` sections apply on the node."""
    state_dir: str
    """Node-local directory for sandbox workspaces (one per agent: a restarted agent reaps
    what its dead predecessor left there, and never what a live neighbour holds)."""
    slots: int
    handlers: Mapping[str, str] = field(default_factory=dict)
    """Environments registered in code, as ``name -> "module:attribute"`` (a class or an
    instance), beside the ``rollout.environments`` entry points."""


def load_handler(path: str) -> AgentHandler:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise InvalidArgument(f"handler {path!r} must be 'module:attribute'", "BAD_CONFIG",
                              "cluster.handlers")
    obj = getattr(importlib.import_module(module), attr)
    handler = obj() if isinstance(obj, type) else obj
    if not isinstance(handler, AgentHandler):
        raise InvalidArgument(f"{path} is not an AgentHandler", "BAD_CONFIG", "cluster.handlers")
    return handler


@dataclass(eq=False)
class _Held:
    ctx: JobContext
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    task: asyncio.Task[StageResult] | None = None


class NodeAgent:
    def __init__(self, spec: AgentSpec) -> None:
        from rollout.server.app import build_sandbox_factory

        self.spec = spec
        self.registry = HandlerRegistry.from_entry_points()
        for name, path in spec.handlers.items():
            self.registry.register(name, load_handler(path))
        cfg = copy.deepcopy(spec.config)
        cfg.server.state_dir = spec.state_dir
        os.makedirs(spec.state_dir, exist_ok=True)
        self.sandbox_factory = build_sandbox_factory(cfg)
        self._cfg = cfg
        self._llm: Any = None
        self._gateway: Any = None
        self._llm_lock = asyncio.Lock()
        self._jobs: dict[str, _Held] = {}

    def info(self) -> dict[str, Any]:
        return {"name": self.spec.name, "pid": os.getpid(), "slots": self.spec.slots,
                "held": len(self._jobs), "host": socket.gethostname()}

    async def _get_llm(self) -> Any:
        if not self._cfg.llm.backends:
            return None
        async with self._llm_lock:
            if self._llm is None:
                from rollout.server.llm.factory import build_pool

                self._llm = await build_pool(self._cfg)
            return self._llm

    async def _get_gateway(self) -> Any:
        # The node's own gateway: a job's sandbox is on this node, so its socket must be too.
        if self._gateway is None:
            from rollout.server.gateway import Gateway

            self._gateway = await Gateway(self._cfg.state_path).start()
        return self._gateway

    async def run_stage(self, spec: JobSpec, stage: Stage, timeout_s: float) -> StageReply:
        job_id = spec.job_id
        if stage is Stage.INIT:
            old = self._jobs.pop(job_id, None)
            if old is not None:  # a second INIT of the same job here: free the first first
                await self._release(old, 5.0)
            llm = await self._get_llm()
            held = _Held(JobContext(spec=spec, llm=llm, sandbox_factory=self.sandbox_factory,
                                    gateway=await self._get_gateway() if llm else None))
            held.ctx.progress = lambda ev, d: held.events.append((ev, dict(d)))
            self._jobs[job_id] = held
        else:
            found = self._jobs.get(job_id)
            if found is None:
                return StageReply(StageResult(JobError(
                    "INTERNAL", "NODE_STATE_LOST",
                    f"node {self.spec.name} holds no context for job {job_id}", stage)))
            held = found
        held.ctx.stage = stage
        try:
            handler = self.registry.get(spec.environment)
        except InvalidArgument as exc:
            return StageReply(StageResult(JobError("INVALID_TASK", exc.reason, str(exc), stage)))
        held.task = asyncio.ensure_future(run_stage(handler, held.ctx, stage, timeout_s))
        try:
            result = await held.task
        finally:
            held.task = None
        if stage is Stage.RUN and held.ctx.outcome is not None:
            held.ctx.outcome.metadata[NODE_KEY] = self.spec.name
        return self._reply(held, result)

    def drain_progress(self) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        """The progress events of every job here since the last drain or stage reply (the
        server polls this while stages run, so a trainer sees turns as they finish)."""
        out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for job_id, held in self._jobs.items():
            if held.events:
                out[job_id], held.events = held.events, []
        return out

    async def release(self, job_id: str, deadline_s: float) -> StageReply:
        held = self._jobs.pop(job_id, None)
        if held is None:
            return StageReply(StageResult())
        await self._release(held, deadline_s)
        return self._reply(held, StageResult())

    async def _release(self, held: _Held, deadline_s: float) -> None:
        task = held.task
        if task is not None and not task.done():  # the server cancelled the stage
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        try:
            handler: AgentHandler | None = self.registry.get(held.ctx.spec.environment)
        except InvalidArgument:
            handler = None
        await release(handler, held.ctx, self._llm, held.ctx.spec.job_id, deadline_s)

    @staticmethod
    def _reply(held: _Held, result: StageResult) -> StageReply:
        ctx = held.ctx
        events, held.events = held.events, []
        seed = ctx.state.get(SEED_KEY)
        live = ctx.outcome is None
        return StageReply(result, outcome=ctx.outcome,
                          turns=list(ctx.state.get(TURNS_KEY, ())) if live else [],
                          segments=list(ctx.state.get(SEGMENTS_KEY, ())) if live else [],
                          seed=seed if isinstance(seed, int) else None, progress=events)

    @property
    def sandboxes_dir(self) -> Path:
        """Where this agent's sandboxes live (``SandboxConfig.sandboxes_dir`` of its state
        dir): its own, never a neighbour agent's."""
        from rollout.runtime.sandbox import SandboxConfig

        return SandboxConfig(state_dir=self._cfg.state_path).sandboxes_dir

    async def close(self) -> None:
        """Release every job held here, then sweep the agent's sandbox root, so a closed
        agent leaves no sandbox, mount or memory cgroup on its host."""
        from rollout.runtime.sandbox import settle_abandoned
        from rollout.server.app import reap_stale_logged, sandbox_pool_of

        for job_id in list(self._jobs):
            await self.release(job_id, 5.0)
        if (pool := sandbox_pool_of(self.sandbox_factory)) is not None:
            await pool.close()
        # INITs cancelled while their sandbox was being made tear it down in a thread: wait
        # for that first, or the sweep sees those sandboxes as live (locked) and skips them.
        await settle_abandoned(10.0)
        if self._gateway is not None:
            with contextlib.suppress(Exception):
                await self._gateway.stop()
        if self._llm is not None:
            with contextlib.suppress(Exception):
                await self._llm.close()
        # Whatever the releases left (a teardown past its deadline, a sandbox of a process
        # that died on this node) would otherwise wait for the next agent on this state dir,
        # which may never start (a --ray node that leaves the cluster keeps its mounts).
        await asyncio.to_thread(reap_stale_logged, self.sandboxes_dir)
