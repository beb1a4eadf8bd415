"""The agent-handler interface: what an environment implements, and the registry of them.

An environment is a class with ``init`` / ``run`` / ``eval`` / ``cleanup`` coroutines. The server
runs them in three stage pools (INIT, RUN, EVAL); a job's stages may run in different worker
tasks, so anything a handler keeps between stages goes in ``ctx.state``.

Third parties add environments without editing the server by declaring an entry point in the
``rollout.environments`` group::

    [project.entry-points."rollout.environments"]
    my_env = "my_package.envs:MyHandler"
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from rollout.runtime.gateway import ModelGateway
from rollout.runtime.llm import LLMClient
from rollout.runtime.types import (
    InvalidArgument,
    JobSpec,
    Reward,
    Segment,
    Stage,
    TerminationReason,
    Turn,
)

ENTRY_POINT_GROUP = "rollout.environments"


class HandlerError(RuntimeError):
    """The handler failed for a reason of its own (bad task data, tool crash). Not retried."""

    def __init__(self, message: str, reason: str = "HANDLER_ERROR") -> None:
        super().__init__(message)
        self.reason = reason


class PolicyFault(HandlerError):
    """What the policy did made the stage impossible to finish (a workspace over quota, code
    under test that hangs the grader): the job SUCCEEDS with reward 0 and ``termination``,
    never FAILED, since trainers mask failed jobs and a policy would learn to turn a 0 into
    no sample at all. Only what the service caused is a failure (docs/failures.md)."""

    def __init__(self, message: str, termination: TerminationReason) -> None:
        super().__init__(message, termination.name)
        self.termination = termination


@dataclass
class RunOutcome:
    """What RUN produces: the turns of the trajectory and why the loop stopped."""

    turns: list[Turn]
    termination: TerminationReason
    metadata: dict[str, str] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    """Where each separate token sequence of ``turns`` begins (a harness that rewrote its
    history); empty for one merged sequence."""


ProgressFn = Callable[[str, Mapping[str, Any]], None]
"""``progress(event, details)``: handlers report e.g. ``("turn", {"turn": 3})``."""


@dataclass
class JobContext:
    """Everything a handler sees of its job. One context lives across the job's three stages."""

    spec: JobSpec
    llm: LLMClient | None = None
    """The backend pool (None for environments that need no model, e.g. test handlers)."""
    sandbox_factory: Callable[..., Awaitable[Any]] | None = None
    """``await sandbox_factory(**options)`` returns a started ``runtime.sandbox`` sandbox."""
    state: dict[str, Any] = field(default_factory=dict)
    """Scratch space carried from INIT to RUN to EVAL (sandbox handle, repo path, …)."""
    outcome: RunOutcome | None = None
    """Set by the scheduler after RUN so EVAL can read the trajectory."""
    progress: ProgressFn = lambda event, details: None
    stage: Stage | None = None
    gateway: ModelGateway | None = None
    """The server's model gateway, for environments whose agent is an external harness that
    calls an OpenAI/Anthropic-compatible endpoint (None where the server runs none)."""
    resources: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    """Closed by the scheduler when the job ends for any reason (success, failure, timeout,
    cancel), so whatever a handler registers here is always released."""

    async def open_sandbox(self, **options: Any) -> Any:
        """Create a sandbox that is destroyed when the job ends, whatever happens."""
        if self.sandbox_factory is None:
            raise HandlerError("this server has no sandbox runtime configured", "NO_SANDBOX")
        sandbox = await self.sandbox_factory(**options)
        self.resources.push_async_callback(sandbox.destroy)
        return sandbox


class AgentHandler(abc.ABC):
    """Base class for environments. Subclasses set ``name`` and implement the stages."""

    name: str = ""

    def validate_task(self, task: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Check a task payload at submit time; raise :class:`InvalidArgument` to reject it."""

    @abc.abstractmethod
    async def init(self, ctx: JobContext) -> None:
        """Create the sandbox and set the task up."""

    @abc.abstractmethod
    async def run(self, ctx: JobContext) -> RunOutcome:
        """The multi-turn agent loop."""

    @abc.abstractmethod
    async def eval(self, ctx: JobContext) -> Reward:
        """Score what RUN did."""

    async def cleanup(self, ctx: JobContext) -> None:  # noqa: B027 - optional hook
        """Called once when the job ends, whatever happened; ``ctx.resources`` closes after."""


class HandlerRegistry:
    """Environments by name: built-ins and entry points, plus ones registered in code (tests)."""

    def __init__(self) -> None:
        self._factories: dict[str, Callable[[], AgentHandler]] = {}
        self._instances: dict[str, AgentHandler] = {}

    @classmethod
    def from_entry_points(cls) -> HandlerRegistry:
        reg = cls()
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            reg._factories[ep.name] = _lazy(ep)
        return reg

    def register(self, name: str, factory: Callable[[], AgentHandler] | AgentHandler) -> None:
        if isinstance(factory, AgentHandler):
            self._instances[name] = factory
        else:
            self._factories[name] = factory
            self._instances.pop(name, None)

    def names(self) -> list[str]:
        return sorted(set(self._factories) | set(self._instances))

    def get(self, name: str) -> AgentHandler:
        if name not in self._instances:
            if name not in self._factories:
                known = ", ".join(self.names()) or "none"
                # Cut short: a client's 20 KB name echoed whole would overflow the default
                # 8 KiB metadata limit and reach the client as RESOURCE_EXHAUSTED instead.
                shown = f"{name[:40]!r}{'...' if len(name) > 40 else ''}"
                raise InvalidArgument(
                    f"unknown environment {shown}; this server has: {known}",
                    "UNKNOWN_ENVIRONMENT", "environment")
            self._instances[name] = self._factories[name]()
        return self._instances[name]


def _lazy(ep: Any) -> Callable[[], AgentHandler]:
    def make() -> AgentHandler:
        obj = ep.load()
        return obj() if isinstance(obj, type) else obj
    return make
