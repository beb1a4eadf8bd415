"""Whose job or group this is: the tenancy checks the RPCs and the stream session share.

A client bound to a credential (``server/tenancy/auth.py``) sees and cancels only what it owns.
Permission is checked before existence, so a bound client gets the same PERMISSION_DENIED for a
job or group that does not exist as for another client's: it cannot probe for other tenants'
ids. Joining a group is decided where the job is inserted (``Scheduler.submit(own_groups=)``,
in the store's transaction), so two tenants racing for a fresh group id cannot both win.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout.server.api import errors
from rollout.server.scheduler import Scheduler
from rollout.server.tenancy import auth


def sees_job(principal: auth.Principal, stored_client_id: str) -> bool:
    """THE ownership predicate, for every route that shows or touches a job (gRPC, the
    stream session, the dashboard's pages and live updates): the operator (no per-client
    credential, or the single ``auth_token``) sees every job; a bound principal sees the
    jobs its client id owns (``auth.owner_of``), nothing else.

    What ``admin`` means, everywhere: a bound client with ``roles = ["admin"]`` may call
    BackendService and sees the server-wide figures (GetServerStatus, the dashboard's overview:
    counts of every tenant's jobs by state and termination, backends, nodes). It does not see
    or act on other tenants' jobs: only the operator does."""
    return principal.owns(stored_client_id)


def sees_group(principal: auth.Principal, owners: Iterable[str]) -> bool:
    """A group is visible only when it exists and every job in it passes :func:`sees_job` (a
    group holding another client's job is as invisible as one that does not exist)."""
    found = list(owners)
    return bool(found) and all(sees_job(principal, o) for o in found)


def job_scope(principal: auth.Principal) -> str | None:
    """The client id a principal's job lists are confined to (None: every job)."""
    return principal.client_id


def sees_server_figures(principal: auth.Principal) -> bool:
    """Whether counts of every tenant's jobs, the backends and the nodes are shown."""
    return not principal.bound or principal.admin


async def group_owners(scheduler: Scheduler, group_id: str, limit: int = 0) -> set[str]:
    """The stored client ids of the group's jobs (stop after a page of ``limit`` jobs)."""
    owners: set[str] = set()
    token = ""
    while True:
        recs, token = await scheduler.list(page_size=1000, page_token=token, group_id=group_id)
        owners.update(r.client_id for r in recs)
        if not token or (limit and len(recs) >= limit):
            return owners


def job_id_taken(job_id: str) -> errors.AlreadyExists:
    return errors.AlreadyExists(
        f"job_id {job_id!r} belongs to another client; job ids are owned by the client that "
        "first submitted them: choose another id (e.g. prefix your client id)", "JOB_ID_TAKEN",
        "job_id")


class Ownership:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    async def check(self, job_id: str | None = None, group_id: str | None = None) -> None:
        """Raise PERMISSION_DENIED unless the calling principal owns the job / every job of the
        group (an unbound principal owns everything)."""
        principal = auth.current.get()
        if not principal.bound:
            return
        if job_id is not None:
            rec = await self._scheduler.get(job_id)
            if rec is None or not sees_job(principal, rec.client_id):
                raise principal.denied_job(job_id)
        if group_id is not None:
            if not sees_group(principal, await self.group_owners(group_id)):
                raise errors.PermissionDenied(
                    f"no group {group_id!r} is visible to client {principal.client_id!r} (it "
                    "does not exist, or holds another client's jobs)", "GROUP_NOT_ACCESSIBLE",
                    "group_id")

    async def group_owners(self, group_id: str, limit: int = 0) -> set[str]:
        """The stored client ids of the group's jobs (stop after a page of ``limit`` jobs)."""
        return await group_owners(self._scheduler, group_id, limit)
