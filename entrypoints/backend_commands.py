"""``rollout backends list|add|remove|update-weights|set-version``: the BackendService RPCs.

Registered by ``entrypoints/cli.py`` through :func:`add_parser`; each subcommand's ``handler`` gets
the parsed arguments and the resolved client settings (address, token). Failures become
:class:`~rollout.client.errors.RolloutError`, which the CLI prints as one
``CODE REASON: message`` line.
"""

from __future__ import annotations

import argparse
from typing import Any

import grpc
from rich.console import Console
from rich.table import Table

from rollout.client.errors import RolloutError
from rollout.entrypoints.tables import cli_console, compact_table
from rollout.v1 import backend_service_pb2 as pb
from rollout.v1 import backend_service_pb2_grpc as pb_grpc

_PROTOCOLS = {"generate": pb.HTTP_PROTOCOL_GENERATE, "completions": pb.HTTP_PROTOCOL_COMPLETIONS}


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="server address (env ROLLOUT_ADDRESS)")
    p.add_argument("--token", help="bearer token (env ROLLOUT_TOKEN)")
    p.add_argument("--config", help="TOML file with a [client] table (env ROLLOUT_CONFIG)")
    p.add_argument("--timeout", type=float, default=600.0, help="RPC deadline in seconds")


def add_parser(subparsers: Any) -> None:
    """Register ``backends`` and its subcommands on the ``rollout`` parser."""
    p = subparsers.add_parser("backends", help="list, add or remove LLM backends; hot-swap "
                              "policy weights")
    sub = p.add_subparsers(dest="backends_command", required=True)

    q = sub.add_parser("list", help="backends with their load, state and policy version")
    _flags(q)
    q.set_defaults(handler=_run)

    q = sub.add_parser("add", help="add a backend: --url (vLLM / llm-serve over HTTP), "
                       "--in-process, or --launch-vllm")
    _flags(q)
    q.add_argument("name")
    how = q.add_mutually_exclusive_group(required=True)
    how.add_argument("--url", help="base URL of a vLLM or `rollout llm-serve` server")
    how.add_argument("--in-process", action="store_true",
                     help="load a transformers model into the server (--model: a directory; "
                     "default the embedded SmolLM2)")
    how.add_argument("--launch-vllm", action="store_true",
                     help="have the server run `vllm serve --model ...`")
    q.add_argument("--model", default="", help="model name (HTTP) or path")
    q.add_argument("--weight", type=float, default=1.0, help="relative capacity")
    q.add_argument("--protocol", choices=sorted(_PROTOCOLS), default="generate")
    q.add_argument("--policy-version", type=int, default=0)
    q.add_argument("--device", default="", help="in-process: cpu, cuda:0, ...")
    q.add_argument("--port", type=int, default=0, help="launched vLLM: port (0 = free)")
    q.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="launched vLLM: extra argument (repeatable)")
    q.set_defaults(handler=_run)

    q = sub.add_parser("remove", help="stop routing to a backend; it closes when idle")
    _flags(q)
    q.add_argument("name")
    q.set_defaults(handler=_run)

    q = sub.add_parser("update-weights", help="hot-swap a checkpoint (rolling, no interruption)")
    _flags(q)
    q.add_argument("checkpoint_path")
    q.add_argument("--version", type=int, required=True, help="policy version it becomes")
    q.add_argument("--backend", action="append", default=[], help="only these (repeatable)")
    q.set_defaults(handler=_run)

    q = sub.add_parser("set-version", help="label backends whose weights were pushed out of "
                       "band")
    _flags(q)
    q.add_argument("version", type=int)
    q.add_argument("--backend", action="append", default=[], help="only these (repeatable)")
    q.set_defaults(handler=_run)


def _run(args: argparse.Namespace, settings: Any, console: Console | None = None) -> int:
    console = console or cli_console()
    metadata = [("authorization", f"Bearer {settings.token}")] if settings.token else []
    with grpc.insecure_channel(settings.address) as channel:
        stub = pb_grpc.BackendServiceStub(channel)
        try:
            return _call(args, stub, metadata, console)
        except grpc.RpcError as err:
            raise RolloutError.from_rpc_error(err) from None


def _call(args: argparse.Namespace, stub: pb_grpc.BackendServiceStub,
          metadata: list[tuple[str, str]], console: Console) -> int:
    kw: dict[str, Any] = {"metadata": metadata, "timeout": args.timeout}
    command = args.backends_command
    if command == "list":
        backends: list[pb.Backend] = []
        token = ""
        while True:
            page = stub.ListBackends(pb.ListBackendsRequest(page_token=token), **kw)
            backends += page.backends
            token = page.next_page_token
            if not token:
                break
        console.print(backend_table(backends))
    elif command == "add":
        request = pb.AddBackendRequest(name=args.name, weight=args.weight)
        if args.url:
            request.http.CopyFrom(pb.HttpBackendSource(
                url=args.url, model=args.model, protocol=_PROTOCOLS[args.protocol],
                policy_version=args.policy_version))
        elif args.in_process:
            request.in_process.CopyFrom(pb.InProcessBackendSource(model_path=args.model,
                                                                  device=args.device))
        else:
            request.managed_vllm.CopyFrom(pb.ManagedVllmBackendSource(
                model=args.model, port=args.port, extra_args=args.vllm_arg))
        console.print(backend_table([stub.AddBackend(request, **kw).backend]))
    elif command == "remove":
        reply = stub.RemoveBackend(pb.RemoveBackendRequest(name=args.name), **kw)
        console.print(backend_table([reply.backend]))
    elif command == "update-weights":
        reply = stub.UpdateWeights(pb.UpdateWeightsRequest(
            checkpoint_path=args.checkpoint_path, policy_version=args.version,
            backend_names=args.backend), **kw)
        console.print(backend_table(list(reply.backends)))
        console.print(f"updated in {reply.duration.ToNanoseconds() / 1e9:.2f} s")
    else:
        reply = stub.SetPolicyVersion(pb.SetPolicyVersionRequest(
            policy_version=args.version, backend_names=args.backend), **kw)
        console.print(backend_table(list(reply.backends)))
    return 0


def backend_table(backends: list[pb.Backend]) -> Table:
    where = [f"{b.name}: {' '.join(x for x in (b.address, b.model) if x)}"
             + (f"; last error: {b.last_error[:80]}" if b.last_error else "") for b in backends]
    table = compact_table(
        "LLM backends", ("name", "kind", "state", "load", "wt", "ver", "turns", "fails",
                         "sess"), left=("name", "kind", "state"),
        caption="\n".join(["load: turns in flight; wt: weight; ver: policy version; "
                            "turns: served; sess: sticky sessions", *where]))
    for b in backends:
        table.add_row(
            b.name, pb.BackendKind.Name(b.kind).removeprefix("BACKEND_KIND_"),
            pb.Backend.State.Name(b.state).removeprefix("STATE_"), str(b.in_flight),
            f"{b.weight:g}", str(b.policy_version), str(b.served_turns), str(b.failures),
            str(b.sessions))
    return table
