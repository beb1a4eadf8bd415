"""Grading where the policy cannot reach: the agent's processes end with RUN, and EVAL works in a
sandbox of its own.

A policy under RL finds every shortcut in its reward: a background process that rewrites the
solution while the hidden tests run, a forged report planted where the grader will look, a
tool process still holding the workspace. So EVAL never runs in the agent's sandbox:

1. :func:`end_agent` closes the agent's tools (bash pty, IPython kernel) and kills every process
   of its sandbox, background ones included (by launch tag, and by uid when the server is root).
2. :func:`open_grader` opens a *second* sandbox — a fresh ``/tmp``, its own PID namespace and,
   when the server runs as root, its own uid — and copies the agent's workspace into it on the
   host (no link followed, FIFOs dropped). Nothing the agent started can see it.
3. The environment's grader runs there and reads its result from a channel that only the
   grader holds (the code runner's nonce-stamped line, pytest's JUnit XML at a fresh path).

A workspace the grader cannot copy because of what the agent left there (over the copy's
budget, sparse files included, or unreadable entries) is a :class:`PolicyFault`: reward 0,
never a failed job a trainer would mask.
"""

from __future__ import annotations

import errno
from typing import Any

from rollout.runtime.envs.common import SANDBOX_KEY, sandbox_of
from rollout.runtime.handler import JobContext, PolicyFault
from rollout.runtime.sandbox.hostfs import TreeTooLarge
from rollout.runtime.types import TerminationReason


async def end_agent(ctx: JobContext) -> None:
    """Close the agent's tools and kill everything running in its sandbox (idempotent)."""
    sandbox = ctx.state.get(SANDBOX_KEY)
    if sandbox is not None and not sandbox.destroyed:
        await sandbox.stop_processes()


async def open_grader(ctx: JobContext, *, skip: frozenset[str] = frozenset(),
                      **options: Any) -> Any:
    """A fresh sandbox holding a copy of the agent's workspace (minus ``skip``, top-level
    names), opened with ``options`` (the ones the agent's sandbox had: the task
    environment's binds, or the task's own Apptainer image, so the tests run in the same
    environment the agent had). The job's resources destroy it at the latest when the job ends;
    callers destroy it as soon as they have their result."""
    agent = sandbox_of(ctx)
    await end_agent(ctx)
    grader = await ctx.open_sandbox(**options)
    try:
        await grader.copy_workspace_from(agent, skip=skip)
    except BaseException as e:
        await grader.destroy()
        if (fault := policy_fault(e)) is not None:
            raise fault from e
        raise
    return grader


_TOO_LARGE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_UNGRADABLE = frozenset({errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.ELOOP,
                         errno.ENOTDIR, errno.EISDIR})


def policy_fault(error: BaseException) -> PolicyFault | None:
    """The reward-0 outcome of a copy that failed because of the tree the agent left: over the
    copy's budget or the grader's disk, or entries it made unreadable. Anything else (a
    sandbox that did not start, an I/O error) stays the service's failure."""
    if isinstance(error, TreeTooLarge) or (isinstance(error, OSError)
                                           and error.errno in _TOO_LARGE):
        return PolicyFault(f"cannot grade: {error}", TerminationReason.WORKSPACE_TOO_LARGE)
    if isinstance(error, OSError) and error.errno in _UNGRADABLE:
        return PolicyFault(f"cannot grade: {error}", TerminationReason.WORKSPACE_UNGRADABLE)
    return None
