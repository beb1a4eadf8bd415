"""``rollout jobs …`` and ``rollout status``: thin renderings of the unary RPCs."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console
from rich.table import Table

from rollout.client.aio import RolloutClient
from rollout.client.errors import RolloutError
from rollout.entrypoints.tables import cli_console, compact_table
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb


def _client(settings: Any) -> RolloutClient:
    return RolloutClient(settings.address, token=settings.token)


def state_name(value: int) -> str:
    return job_pb2.Job.State.Name(value).removeprefix("STATE_")


def stage_name(value: int) -> str:
    return job_pb2.Stage.Name(value).removeprefix("STAGE_")


def fmt_duration(d: Duration) -> str:
    s = d.ToNanoseconds() / 1e9
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s" if s < 120 else f"{s / 60:.1f} min"


def _fmt_time(ts: Timestamp) -> str:
    return ts.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if ts.seconds else ""


async def jobs(args: argparse.Namespace, settings: Any, console: Console | None = None) -> int:
    console = console or cli_console()
    async with _client(settings) as client:
        if args.jobs_command == "list":
            table = compact_table("jobs", ("job", "env", "state", "stage", "tries", "reward",
                                           "group", "created"),
                                  left=("job", "env", "state", "stage", "group"))
            n = 0
            async for job in client.list_jobs(state=args.state or 0, group_id=args.group,
                                              client_id=args.client_id, limit=args.limit):
                n += 1
                table.add_row(job.job_id, job.spec.environment, state_name(job.state),
                              stage_name(job.stage), str(job.attempts),
                              f"{job.reward:.3f}" if job.state == job.STATE_SUCCEEDED else "",
                              job.spec.group.group_id, _fmt_time(job.create_time))
            console.print(table)
            console.print(f"{n} job(s)")
        elif args.jobs_command == "show":
            from rollout.entrypoints.job_show import show

            return await show(args, client, console)
        elif args.jobs_command == "get":
            resp = await client.get_job(args.job_id, include_trajectory=args.trajectory)
            console.print_json(json_format.MessageToJson(resp, preserving_proto_field_name=True))
        else:
            from rollout.entrypoints.cli import CliError

            if sum(map(bool, (args.job_id, args.group, args.all_mine))) != 1:
                raise CliError("INVALID_ARGUMENT", "MISSING_FIELD",
                               "name a job id, --group or --all-mine (exactly one)")
            if args.all_mine:
                if not settings.client_id:
                    raise CliError("INVALID_ARGUMENT", "MISSING_FIELD",
                                   "--all-mine needs --client-id (the id `rollout submit` "
                                   "printed) or ROLLOUT_CLIENT_ID")
                ids = await cancel_unfinished(client, settings.client_id)
            else:
                ids = await client.cancel(job_id=args.job_id, group_id=args.group)
            console.print(f"cancelled {len(ids)} job(s)" + (": " + ", ".join(ids) if ids else ""))
    return 0


async def cancel_unfinished(client: RolloutClient, client_id: str) -> list[str]:
    """Cancel every queued or running job of ``client_id``; returns the ids cancelled (a job
    that finished meanwhile is skipped, not an error)."""
    ids = [job.job_id for state in ("QUEUED", "RUNNING")
           async for job in client.list_jobs(state=state, client_id=client_id)]
    return await cancel_each(client, ids)


async def cancel_each(client: RolloutClient, job_ids: list[str]) -> list[str]:
    """Cancel ``job_ids`` (16 calls in flight at most); returns those actually cancelled."""
    gate = asyncio.Semaphore(16)

    async def one(job_id: str) -> list[str]:
        async with gate:
            try:
                return await client.cancel(job_id=job_id)
            except RolloutError as err:  # finished meanwhile, or pruned: nothing to cancel
                if err.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    return []
                raise

    return [i for ids in await asyncio.gather(*(one(j) for j in job_ids)) for i in ids]


async def status(settings: Any, console: Console | None = None) -> int:
    console = console or cli_console()
    async with _client(settings) as client:
        st = await client.status()
    render_status(st, console)
    return 0


_TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


def render_status(st: pb.GetServerStatusResponse, console: Console) -> None:
    """Print a GetServerStatus answer: the stage table, job counts, how runs ended, the
    environments and, when stage work runs on nodes (``--workers`` / ``--ray``), a node table.
    A tenant's answer has no termination breakdown and no nodes; it renders as well."""
    table = compact_table(f"rollout service {st.version} — up {fmt_duration(st.uptime)}, "
                          f"{st.sessions} session(s)",
                          ("stage", "workers", "queued", "in flight", "completed", "failed",
                           "p50", "p95", "jobs/s"), left=("stage",))
    for s in st.stages:
        table.add_row(stage_name(s.stage), str(s.workers), str(s.queue_depth),
                      str(s.in_flight), str(s.completed), str(s.failed),
                      fmt_duration(s.latency_p50), fmt_duration(s.latency_p95),
                      f"{s.throughput_per_second:.2f}")
    console.print(table)
    counts = ", ".join(f"{k.removeprefix('STATE_')}={v}"
                       for k, v in sorted(st.jobs_by_state.items())) or "none"
    console.print(f"jobs: {counts}")
    # By state alone a job whose agent ran out of RUN time is a success; say how runs ended.
    ended = ", ".join(f"{k.lower().replace('_', ' ')}={v}" for k, v in sorted(
        st.jobs_by_termination.items(), key=lambda kv: (-kv[1], kv[0])))
    if not ended:
        # The server leaves the breakdown out for a tenant (admins only): with finished jobs
        # counted and no breakdown, "none yet" would be false.
        finished = sum(n for k, n in st.jobs_by_state.items()
                       if k.removeprefix("STATE_") in _TERMINAL_STATES)
        ended = "not shown (admins only)" if finished else "none yet"
    console.print(f"runs ended by: {ended}")
    console.print(f"environments: {', '.join(st.environments) or 'none'}")
    if st.nodes:
        console.print(node_table(st.nodes))


def node_table(nodes: Sequence[pb.NodeStatus]) -> Table:
    """One row per node: where its agent runs, whether the server still has it, its slots and
    held jobs, busy/capacity per stage (pipeline order) and the jobs it finished."""
    stages: list[int] = []
    for node in nodes:  # a lost node may report no stages; take the order from the others
        for s in node.stages:
            if s.stage not in stages:
                stages.append(s.stage)
    columns = ("node", "host", "pid", "alive", "slots", "held",
               *(f"{stage_name(s).lower()} busy" for s in stages), "assigned", "done")
    table = compact_table(f"{len(nodes)} node(s)", columns, left=("node", "host", "alive"))
    for node in nodes:
        per_stage = {s.stage: s for s in node.stages}
        busy = [f"{per_stage[s].busy}/{per_stage[s].capacity}" if s in per_stage else "-"
                for s in stages]
        table.add_row(node.name, node.address, str(node.pid),
                      "yes" if node.alive else "LOST", str(node.slots), str(node.held),
                      *busy, str(node.jobs_assigned), str(node.jobs_done))
    return table
