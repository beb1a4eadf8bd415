"""Nodes: what the scheduler hands a job's stages to, and the set it picks them from.

A node owns the sandboxes, tool processes and graders of the jobs it holds. The scheduler picks
one when a job starts INIT (:meth:`NodeSet.acquire`: the least-loaded node with a free slot),
runs all three stages there (the sandbox lives there), and gives the slot back when the job's
resources are released. A node that dies raises :class:`NodeLost` from a stage or a release;
the scheduler then runs the job again from INIT elsewhere, counted as a crash attempt.

Two kinds exist: :class:`LocalNode` (the server process itself: the job's context is the real
one, exactly the behaviour of a single-process server) and ``ray_backend.RayNode`` (an actor
on a Ray node: the server keeps a *shadow* context that the node's replies keep up to date, so
a trajectory can be built on the server side whatever happened to the node).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout.runtime.agent_loop import SEED_KEY, TURNS_KEY
from rollout.runtime.gateway import SEGMENTS_KEY, ModelGateway
from rollout.runtime.handler import HandlerRegistry, JobContext, ProgressFn, RunOutcome
from rollout.runtime.llm import LLMClient
from rollout.runtime.types import InvalidArgument, JobError, JobSpec, Segment, Stage, Turn
from rollout.server.pipeline.stages import StageResult, release, run_stage

log = logging.getLogger(__name__)


KEEP_GONE = 32
"""Removed nodes that status keeps showing (not alive) until they come back."""


class NodeLost(Exception):
    """The node holding a job went away (process, actor or machine died)."""

    def __init__(self, node: str, detail: str) -> None:
        super().__init__(f"node {node} was lost: {detail}")
        self.node = node


@dataclass(slots=True)
class StageReply:
    """What a remote node sends back after a stage (or a release): enough for the server to
    build the job's trajectory without the node. Plain data, so it crosses process bounds."""

    result: StageResult
    outcome: RunOutcome | None = None
    turns: list[Turn] = field(default_factory=list)
    """Turns the agent loop finished so far (a RUN cut by a timeout or cancel keeps them)."""
    seed: int | None = None
    segments: list[Segment] = field(default_factory=list)
    """Where each token sequence of ``turns`` begins (a harness job's live capture)."""
    progress: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """The handler's own progress events during the stage, in order."""

    def apply(self, ctx: JobContext) -> None:
        """Bring a shadow context up to date (what ``build_trajectory`` reads)."""
        if self.outcome is not None:
            ctx.outcome = self.outcome
        if self.turns:
            ctx.state[TURNS_KEY] = list(self.turns)
        if self.segments:
            ctx.state[SEGMENTS_KEY] = list(self.segments)
        if self.seed is not None:
            ctx.state[SEED_KEY] = self.seed
        for event, detail in self.progress:
            ctx.progress(event, detail)


class StageLoad:
    """Stage calls a node is running now, per stage (what GetServerStatus shows as busy)."""

    def __init__(self) -> None:
        self.busy: dict[Stage, int] = dict.fromkeys(Stage, 0)

    @contextlib.contextmanager
    def running(self, stage: Stage) -> Iterator[None]:
        self.busy[stage] += 1
        try:
            yield
        finally:
            self.busy[stage] -= 1


@dataclass(frozen=True)
class NodeStageStatus:
    stage: Stage
    capacity: int
    """Jobs the node advertises for this stage."""
    busy: int
    """Calls of this stage running on the node now."""


@dataclass(frozen=True)
class NodeStatus:
    """A read-only snapshot of one node for GetServerStatus."""

    name: str
    address: str
    """Host the node's agent runs on ("" when the node does not say)."""
    pid: int
    """The agent's process id (0 for the server process itself)."""
    alive: bool
    slots: int
    held: int
    """Jobs (sandboxes) it holds now, whatever stage they are in."""
    stages: tuple[NodeStageStatus, ...]
    jobs_assigned: int
    """Jobs ever placed on it (a job placed again after a lost node counts again)."""
    jobs_done: int
    """Jobs it finished with and gave back (not those lost with it)."""
    in_server: bool = False
    """The server process itself (:class:`LocalNode`), not a node agent."""


class Node(Protocol):
    name: str
    slots: int
    """Jobs (sandboxes) the node holds at once."""
    held: int
    """Jobs it holds now (assigned by the NodeSet)."""
    alive: bool

    def open_context(self, spec: JobSpec, progress: ProgressFn) -> JobContext:
        """The context the scheduler keeps for a job starting INIT on this node."""

    async def run_stage(self, ctx: JobContext, stage: Stage, timeout_s: float) -> StageResult:
        """Run one stage; raises NodeLost if the node died, CancelledError if cancelled."""

    async def release(self, ctx: JobContext, deadline_s: float) -> None:
        """Free what the job holds on the node (idempotent); raises NodeLost."""

    def capacity(self) -> dict[str, int]:
        """Per-stage capacity the node advertises (``{"init": n, "run": n, "eval": n}``)."""


class LocalResources(Protocol):
    """What the server process runs jobs with (the scheduler itself: tests and the server may
    swap its ``llm`` or ``sandbox_factory`` after it is built, and the local node sees that)."""

    registry: HandlerRegistry
    llm: LLMClient | None
    sandbox_factory: Callable[..., Awaitable[Any]] | None
    gateway: ModelGateway | None


class LocalNode:
    """The server process itself: today's in-process execution, unchanged."""

    def __init__(self, resources: LocalResources, name: str = "local") -> None:
        self.name = name
        self._res = resources
        self.slots = 1 << 30  # the stage pools' worker counts are the limit here
        self.held = 0
        self.alive = True
        self.load = StageLoad()

    def open_context(self, spec: JobSpec, progress: ProgressFn) -> JobContext:
        llm = self._res.llm
        return JobContext(spec=spec, llm=llm, sandbox_factory=self._res.sandbox_factory,
                          progress=progress,
                          gateway=getattr(self._res, "gateway", None) if llm else None)

    async def run_stage(self, ctx: JobContext, stage: Stage, timeout_s: float) -> StageResult:
        try:
            handler = self._res.registry.get(ctx.spec.environment)
        except InvalidArgument as exc:  # e.g. recovered after the environment was removed
            return StageResult(JobError("INVALID_TASK", exc.reason, str(exc), stage))
        with self.load.running(stage):
            return await run_stage(handler, ctx, stage, timeout_s)

    async def release(self, ctx: JobContext, deadline_s: float) -> None:
        try:
            handler = self._res.registry.get(ctx.spec.environment)
        except InvalidArgument:
            handler = None
        await release(handler, ctx, self._res.llm, ctx.spec.job_id, deadline_s)

    def capacity(self) -> dict[str, int]:
        return {"init": self.slots, "run": self.slots, "eval": self.slots}


class NodeSet:
    """The nodes stage work may go to; nodes join and leave while the server runs."""

    def __init__(self, nodes: Mapping[str, Node] | None = None) -> None:
        self._nodes: dict[str, Node] = dict(nodes or {})
        self._changed = asyncio.Event()
        self.assigned: dict[str, int] = {}
        """Jobs ever assigned per node name (status and tests: where work went)."""
        self.lost: list[str] = []
        """Names of nodes that were lost, in order."""
        self.done: dict[str, int] = {}
        """Jobs each node finished with and gave back while alive (status)."""
        self._gone: OrderedDict[str, Node] = OrderedDict()
        """The last :data:`KEEP_GONE` nodes removed, so status can show them as not alive."""

    @classmethod
    def single(cls, node: Node) -> NodeSet:
        return cls({node.name: node})

    def __len__(self) -> int:
        return len(self._nodes)

    def names(self) -> list[str]:
        return sorted(self._nodes)

    def get(self, name: str) -> Node | None:
        return self._nodes.get(name)

    def add(self, node: Node) -> None:
        self._nodes[node.name] = node
        log.info("node %s joined (%d slots)", node.name, node.slots)
        self._wake()

    def remove(self, name: str, reason: str = "left", node: Node | None = None) -> Node | None:
        """Take a node out (its in-flight calls fail with NodeLost). With ``node``, only if
        that very object is still the one under ``name`` (not a replacement that joined)."""
        if node is not None and self._nodes.get(name) is not node:
            return None
        node = self._nodes.pop(name, None)
        if node is not None:
            node.alive = False
            self._gone[name] = node
            self._gone.move_to_end(name)
            while len(self._gone) > KEEP_GONE:
                self._gone.popitem(last=False)
            self.lost.append(name)
            log.warning("node %s removed (%s); its jobs run again elsewhere", name, reason)
            self._wake()
        return node

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def pick(self) -> Node | None:
        """The least-loaded live node with a free slot (ties: fewest jobs ever given)."""
        best: Node | None = None
        best_key: tuple[float, int, str] | None = None
        for node in self._nodes.values():
            if not node.alive or node.held >= node.slots:
                continue
            key = (node.held / node.slots, self.assigned.get(node.name, 0), node.name)
            if best_key is None or key < best_key:
                best, best_key = node, key
        return best

    async def acquire(self) -> Node:
        """Take a slot on the least-loaded node, waiting while every node is full (or none
        has joined yet); the wait ends when a slot frees or a node joins."""
        while True:
            node = self.pick()
            if node is not None:
                node.held += 1
                self.assigned[node.name] = self.assigned.get(node.name, 0) + 1
                return node
            await self._changed.wait()

    def give_back(self, node: Node) -> None:
        node.held = max(0, node.held - 1)
        if node.alive:
            self.done[node.name] = self.done.get(node.name, 0) + 1
        self._wake()

    def status(self) -> list[NodeStatus]:
        """Every node, by name, then the recently removed ones that have not come back
        (alive false). Read-only: nothing here changes placement."""
        current = [self._nodes[n] for n in self.names()]
        gone = [node for name, node in self._gone.items() if name not in self._nodes]
        out = []
        for node in current + gone:
            capacity = node.capacity()
            load = getattr(node, "load", None)
            busy = load.busy if isinstance(load, StageLoad) else {}
            out.append(NodeStatus(
                name=node.name, address=str(getattr(node, "address", "")),
                pid=int(getattr(node, "pid", 0)), alive=node.alive, slots=node.slots,
                held=node.held,
                stages=tuple(NodeStageStatus(stage, capacity.get(stage.value, 0),
                                             busy.get(stage, 0)) for stage in Stage),
                jobs_assigned=self.assigned.get(node.name, 0),
                jobs_done=self.done.get(node.name, 0), in_server=isinstance(node, LocalNode)))
        return out
