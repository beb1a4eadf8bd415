"""``rollout status``: the node table for a server whose stage work runs on nodes (a hand-built
GetServerStatus answer, so no Ray cluster is needed), and the views an admin and a tenant get
from a real loopback server."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from rollout.client.sync import RolloutClientSync
from rollout.entrypoints.cli import main
from rollout.entrypoints.job_commands import render_status
from rollout.v1 import job_pb2
from rollout.v1 import rollout_service_pb2 as pb
from tests.client.conftest import ThreadedServer, task

pytestmark = pytest.mark.timeout(60)

ALICE, OPS = "alice-token-0123456789", "ops-token-0123456789"
CLIENTS = [{"client_id": "alice", "token": ALICE},
           {"client_id": "ops", "token": OPS, "roles": ["admin"]}]


def _stages(*cap_busy: tuple[int, int]) -> list[pb.NodeStageStatus]:
    order = (job_pb2.STAGE_INIT, job_pb2.STAGE_RUN, job_pb2.STAGE_EVAL)
    return [pb.NodeStageStatus(stage=s, capacity=c, busy=b)
            for s, (c, b) in zip(order, cap_busy, strict=True)]


def _render(st: pb.GetServerStatusResponse) -> str:
    out = io.StringIO()
    render_status(st, Console(file=out, width=200, color_system=None))
    return out.getvalue()


def _row(text: str, first_cell: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == [first_cell]]
    assert len(rows) == 1, (first_cell, text)
    return rows[0]


def test_nodes_are_tabled_with_busy_per_stage_and_jobs_done() -> None:
    st = pb.GetServerStatusResponse(version="9.9", sessions=1, environments=["io"])
    st.jobs_by_state["RUNNING"] = 4
    st.nodes.extend([
        pb.NodeStatus(name="worker-0", address="host-a", pid=101, alive=True, slots=3, held=3,
                      stages=_stages((3, 1), (3, 2), (2, 0)), jobs_assigned=7, jobs_done=4),
        pb.NodeStatus(name="worker-1", address="host-b", pid=202, alive=True, slots=2, held=1,
                      stages=_stages((2, 0), (2, 1), (2, 0)), jobs_assigned=5, jobs_done=4),
        # Lost: listed, not alive, and a lost node may carry no stage figures.
        pb.NodeStatus(name="node-3f2a", address="host-c", pid=303, alive=False, slots=4,
                      jobs_assigned=2, jobs_done=0),
    ])
    text = _render(st)
    header = _row(text, "node")
    assert header == ["node", "host", "pid", "alive", "slots", "held", "init", "busy", "run",
                      "busy", "eval", "busy", "assigned", "done"]
    assert "3 node(s)" in text
    assert _row(text, "worker-0") == ["worker-0", "host-a", "101", "yes", "3", "3", "1/3",
                                      "2/3", "0/2", "7", "4"]
    assert _row(text, "worker-1") == ["worker-1", "host-b", "202", "yes", "2", "1", "0/2",
                                      "1/2", "0/2", "5", "4"]
    assert _row(text, "node-3f2a") == ["node-3f2a", "host-c", "303", "LOST", "4", "0", "-",
                                       "-", "-", "2", "0"]


def test_no_node_table_when_the_server_runs_stages_itself() -> None:
    st = pb.GetServerStatusResponse(version="9.9", environments=["io"])
    st.stages.append(pb.StageStatus(stage=job_pb2.STAGE_RUN, workers=4))
    text = _render(st)
    assert _row(text, "RUN")[:2] == ["RUN", "4"]
    assert "node(s)" not in text and "runs ended by: none yet" in text


@pytest.fixture
def tenant_server(tmp_path: Path) -> Iterator[ThreadedServer]:
    srv = ThreadedServer(tmp_path / "state", clients=json.dumps(CLIENTS))
    yield srv
    srv.stop()


def test_tenant_and_admin_views_render(tenant_server: ThreadedServer,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with RolloutClientSync(tenant_server.address, token=ALICE) as client:
        for _ in client.submit_rollout({"job_id": "a-1", **task(reward=1.0)}):
            pass
    capsys.readouterr()
    addr = ["--address", tenant_server.address]
    assert main(["status", *addr, "--token", ALICE]) == 0
    tenant = capsys.readouterr().out
    # Alice's own job counted; the termination breakdown and the nodes are an admin's.
    assert "jobs: SUCCEEDED=1" in tenant
    assert "runs ended by: not shown (admins only)" in tenant
    assert _row(tenant, "RUN")[0] == "RUN" and "environments: scripted" in tenant
    assert "node(s)" not in tenant
    assert main(["status", *addr, "--token", OPS]) == 0
    admin = capsys.readouterr().out
    assert "jobs: SUCCEEDED=1" in admin
    ended = next(line for line in admin.splitlines() if line.startswith("runs ended by: "))
    assert "admins only" not in ended and ended.endswith("=1")
    assert "node(s)" not in admin  # stage work runs in the server's own process here
