"""Stage work on Ray: one node-agent actor per node, found and replaced while the server runs.

Imported only for ``rollout serve --ray ADDRESS|auto`` or ``--workers N``; a plain server never
imports Ray. Two ways to find nodes:

- ``--ray``: every live Ray node that offers the custom resource ``rollout_node`` gets one
  agent, pinned to it (``NodeAffinitySchedulingStrategy``, hard) and holding that resource, so
  there is exactly one per node. Its slots are the node's ``rollout_slots`` resource, or
  ``cluster.slots_per_node``. Every ``cluster.poll_s`` the server looks again: a new node gets an
  agent (it takes work at once), a node that left is removed, an agent that died is replaced.
- ``--workers N``: a private local Ray instance with N agents, each its own process. Ray rather
  than multiprocessing because the node-agent code, death detection and replacement are then
  the same as on a cluster, and Ray spawns its workers from its own raylet: nothing is forked
  from the gRPC server process (gRPC's fork handlers can crash a forked child).

A call to a dead agent raises Ray's ``RayActorError``; that becomes ``NodeLost`` and the
scheduler runs the job again from INIT elsewhere (a crash attempt). An exception raised inside an
agent method (a bug) stays an exception: the job fails INTERNAL rather than looping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rollout.runtime.handler import JobContext, ProgressFn
from rollout.runtime.types import InvalidArgument, JobSpec, Stage
from rollout.server.cluster import ray_reaper
from rollout.server.cluster.agent import AgentSpec, NodeAgent
from rollout.server.cluster.node import NodeLost, NodeSet, StageLoad, StageReply
from rollout.server.pipeline.stages import StageResult

log = logging.getLogger(__name__)

NODE_RESOURCE = "rollout_node"
SLOTS_RESOURCE = "rollout_slots"
WORKER_RESOURCE = "rollout_worker"
PROGRESS_POLL_S = 0.25
"""How often the server collects the progress events (agent turns) of running stages."""
AGENT_START_S = 120.0
"""Bound on an agent's start (its process imports the server and builds a sandbox runtime)."""


@ray.remote
class NodeAgentActor:
    """The Ray actor around :class:`NodeAgent` (async: many jobs' stages run at once)."""

    def __init__(self, spec: AgentSpec) -> None:
        logging.basicConfig(level=logging.INFO)
        self.agent = NodeAgent(spec)

    async def info(self) -> dict[str, Any]:
        return self.agent.info()

    async def run_stage(self, spec: JobSpec, stage: Stage, timeout_s: float) -> StageReply:
        return await self.agent.run_stage(spec, stage, timeout_s)

    async def release(self, job_id: str, deadline_s: float) -> StageReply:
        return await self.agent.release(job_id, deadline_s)

    async def drain_progress(self) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        return self.agent.drain_progress()

    async def close(self) -> None:
        await self.agent.close()


class RayNode:
    """A node seen from the server: calls into its agent; keeps a shadow context per job."""

    def __init__(self, name: str, actor: Any, slots: int, pid: int = 0,
                 address: str = "") -> None:
        self.name = name
        self.pid = pid
        """The agent's process id on its node."""
        self.address = address
        """The host the agent runs on (as the agent reports it)."""
        self.load = StageLoad()
        self._contexts: dict[str, JobContext] = {}
        self._drain: asyncio.Future[Any] | None = None
        self.actor = actor
        self.slots = slots
        self.held = 0
        self.alive = True

    def open_context(self, spec: JobSpec, progress: ProgressFn) -> JobContext:
        ctx = JobContext(spec=spec, progress=progress)
        self._contexts[spec.job_id] = ctx
        return ctx

    async def run_stage(self, ctx: JobContext, stage: Stage, timeout_s: float) -> StageResult:
        with self.load.running(stage):
            reply = await self._call(self.actor.run_stage.remote(ctx.spec, stage, timeout_s))
        await self._drained()
        reply.apply(ctx)
        return reply.result

    async def release(self, ctx: JobContext, deadline_s: float) -> None:
        self._contexts.pop(ctx.spec.job_id, None)
        # Handler cleanup, sandbox and LLM session are each bounded by deadline_s on the node.
        async with asyncio.timeout(deadline_s * 3 + 5):
            reply = await self._call(self.actor.release.remote(ctx.spec.job_id, deadline_s))
        reply.apply(ctx)

    async def poll_progress(self) -> None:
        """Forward the progress events the node's stages reported since the last poll."""
        if not self.alive or not self._contexts or self._drain is not None:
            return
        self._drain = fut = asyncio.ensure_future(self.actor.drain_progress.remote())
        try:
            events = await fut
        except RayActorError:
            return  # the stage calls in flight report the loss
        finally:
            self._drain = None
        for job_id, items in events.items():
            ctx = self._contexts.get(job_id)
            if ctx is not None:
                for event, detail in items:
                    ctx.progress(event, detail)

    async def _drained(self) -> None:
        """Events a drain took off the node before this stage's reply was made must be
        forwarded before the reply's own (a turn is never reported after its stage ended)."""
        fut = self._drain
        if fut is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(fut)
            await asyncio.sleep(0)  # let poll_progress forward what it got

    async def _call(self, ref: Any) -> StageReply:
        if not self.alive:
            raise NodeLost(self.name, "removed from the cluster")
        try:
            reply: StageReply = await ref
        except RayActorError as exc:
            raise NodeLost(self.name, type(exc).__name__) from exc
        return reply

    def capacity(self) -> dict[str, int]:
        return {"init": self.slots, "run": self.slots, "eval": self.slots}


def _reap_with_us() -> subprocess.Popen[bytes] | None:
    """Start :mod:`ray_reaper` for the local Ray ``ray.init`` just started (None if the
    raylet cannot be found: the cluster still works, only a SIGKILL leaves agents behind)."""
    node = getattr(ray._private.worker, "_global_node", None)
    raylets = (node.all_processes.get("raylet") or []) if node is not None else []
    pid = getattr(getattr(raylets[0], "process", None), "pid", 0) if raylets else 0
    if not pid:
        log.warning("local Ray's raylet not found; its agents may outlive a killed server")
        return None
    return ray_reaper.spawn(pid)


class RayCluster:
    """Connects to Ray, keeps one agent per node in ``nodes``, disconnects on stop."""

    def __init__(self, nodes: NodeSet, cfg: Any,
                 handlers: Mapping[str, str] | None = None) -> None:
        self.nodes = nodes
        self.cfg = cfg
        self.section = cfg.cluster
        self.handlers = dict(handlers if handlers is not None else cfg.cluster.handlers)
        self._starting: set[str] = set()
        self._actors: dict[str, Any] = {}
        self._watch: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        base = self.section.node_state_dir or os.path.join(tempfile.gettempdir(),
                                                            "rollout-nodes")
        self._state_base = Path(base)
        self._reaper: subprocess.Popen[bytes] | None = None
        """--workers: kills what our private Ray's raylet started if this process dies."""

    async def start(self, wait_for_nodes: float = 0.0) -> RayCluster:
        sec = self.section
        if sec.workers and sec.ray:
            raise InvalidArgument("--workers (cluster.workers) and --ray (cluster.ray) exclude "
                                  "each other: give one", "BAD_CONFIG", "cluster.workers")
        if sec.workers:
            await asyncio.to_thread(
                ray.init, num_cpus=sec.workers, resources={WORKER_RESOURCE: sec.workers},
                include_dashboard=False, object_store_memory=80_000_000, log_to_driver=False,
                configure_logging=False)
            self._reaper = _reap_with_us()
        else:
            await asyncio.to_thread(ray.init, address=sec.ray, log_to_driver=False,
                                    configure_logging=False)
        await self.refresh()
        self._watch = asyncio.ensure_future(self._watch_loop())
        return self

    async def _watch_loop(self) -> None:
        next_refresh = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PROGRESS_POLL_S)
            nodes = [self.nodes.get(name) for name in self.nodes.names()]
            await asyncio.gather(*(n.poll_progress() for n in nodes if isinstance(n, RayNode)),
                                 return_exceptions=True)
            if loop.time() < next_refresh:
                continue
            next_refresh = loop.time() + self.section.poll_s
            try:
                await self.refresh()
            except Exception:  # Ray's GCS busy or restarting: look again next time
                log.exception("looking for Ray nodes failed")

    async def refresh(self) -> None:
        """Start agents on nodes without one; drop the nodes that left."""
        wanted: dict[str, tuple[dict[str, Any], int]] = {}
        if self.section.workers:
            for i in range(self.section.workers):
                wanted[f"worker-{i}"] = ({"resources": {WORKER_RESOURCE: 1}, "num_cpus": 0},
                                         self.section.slots_per_node)
        else:
            for n in await asyncio.to_thread(ray.nodes):
                res = n.get("Resources", {})
                if not n.get("Alive") or res.get(NODE_RESOURCE, 0) < 1:
                    continue
                node_id = n["NodeID"]
                slots = int(res.get(SLOTS_RESOURCE, 0)) or self.section.slots_per_node
                wanted[f"node-{node_id[:12]}"] = ({
                    "resources": {NODE_RESOURCE: 1}, "num_cpus": 0,
                    "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
                }, slots)
        for name in self.nodes.names():
            if name not in wanted:
                self._drop(name, "left the Ray cluster")
        for name, (options, slots) in wanted.items():
            if self.nodes.get(name) is None and name not in self._starting:
                self._starting.add(name)
                task = asyncio.ensure_future(self._start_agent(name, options, slots))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _start_agent(self, name: str, options: dict[str, Any], slots: int) -> None:
        try:
            old = self._actors.pop(name, None)
            if old is not None:  # the agent died but its node lives: make sure, then replace
                with contextlib.suppress(Exception):
                    ray.kill(old, no_restart=True)
            spec = AgentSpec(name=name, config=self.cfg, slots=slots, handlers=self.handlers,
                             state_dir=str(self._state_base / name))
            actor = NodeAgentActor.options(  # type: ignore[attr-defined]  # ray.remote's class
                max_concurrency=10_000, **options).remote(spec)
            async with asyncio.timeout(AGENT_START_S):
                info = await actor.info.remote()
            self._actors[name] = actor
            self.nodes.add(RayNode(name, actor, slots, int(info["pid"]),
                                   str(info.get("host", ""))))
            log.info("node agent %s started (pid %s, %d slots)", name, info["pid"], slots)
        except Exception as exc:
            log.warning("could not start node agent %s: %s; trying again later", name, exc)
        finally:
            self._starting.discard(name)

    def _drop(self, name: str, reason: str) -> None:
        self.nodes.remove(name, reason)
        actor = self._actors.pop(name, None)
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def kill_agent(self, name: str) -> None:
        """Kill one node's agent process (fault injection for tests and ``bench scale``)."""
        actor = self._actors.get(name)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
        for task in list(self._tasks):
            task.cancel()
        for name, actor in list(self._actors.items()):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await actor.close.remote()
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            self._actors.pop(name, None)
        await asyncio.to_thread(ray.shutdown)
        if self._reaper is not None:
            await asyncio.to_thread(ray_reaper.release, self._reaper)
            self._reaper = None
