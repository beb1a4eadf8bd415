"""The ``rollout`` command line.

Client settings (address, token, client id) resolve as: flags > ``ROLLOUT_ADDRESS`` /
``ROLLOUT_TOKEN`` / ``ROLLOUT_CLIENT_ID`` > the ``[client]`` table of a TOML file
(``--config`` or ``$ROLLOUT_CONFIG``) > defaults. ``serve`` hands its configuration to the
server's own loader (``[server]``, ``[pipeline]``, … of the same file; flags win there too).

Every failure prints one line, ``error: CODE REASON: message``, and exits with status 2 —
never a traceback, because the people reading it are running training jobs, not debugging us.
Server-side commands are imported lazily so the client stays light.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.client.aio import DEFAULT_ADDRESS
from rollout.client.errors import RolloutError

BENCHES = ("pipeline", "tools", "llm")


@dataclass(frozen=True)
class ClientSettings:
    address: str = DEFAULT_ADDRESS
    token: str | None = None
    client_id: str | None = None
    """None: ``submit`` derives a stable id from its output path (so a re-run resumes)."""


def resolve_settings(args: argparse.Namespace,
                     environ: Mapping[str, str] | None = None) -> ClientSettings:
    environ = os.environ if environ is None else environ
    path = getattr(args, "config", None) or environ.get("ROLLOUT_CONFIG")
    file_values: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise CliError("INVALID_ARGUMENT", "BAD_CONFIG",
                           f"cannot read config file {path}: {exc}") from None
        table = data.get("client", {})
        if not isinstance(table, dict):
            raise CliError("INVALID_ARGUMENT", "BAD_CONFIG", "config: [client] must be a table")
        unknown = set(table) - {"address", "token", "client_id"}
        if unknown:
            raise CliError("INVALID_ARGUMENT", "BAD_CONFIG",
                           f"config: unknown [client] keys {sorted(unknown)}; known: "
                           "address, token, client_id")
        file_values = table

    def pick(flag: str, env: str, default: Any) -> Any:
        value = getattr(args, flag, None)
        if value:
            return value
        if environ.get(env):
            return environ[env]
        return file_values.get(flag, default)

    return ClientSettings(address=str(pick("address", "ROLLOUT_ADDRESS", DEFAULT_ADDRESS)),
                          token=pick("token", "ROLLOUT_TOKEN", None) or None,
                          client_id=pick("client_id", "ROLLOUT_CLIENT_ID", None) or None)


class CliError(Exception):
    """A local failure (bad file, bad flag), printed like a server error."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


# ------------------------------------------------------------------ parser


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help=f"server address (default {DEFAULT_ADDRESS}; "
                   "env ROLLOUT_ADDRESS)")
    p.add_argument("--token", help="bearer token (env ROLLOUT_TOKEN)")
    p.add_argument("--config", help="TOML file with a [client] table (env ROLLOUT_CONFIG)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description="Rollout Service")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the service")
    p.add_argument("--config", help="TOML configuration (env ROLLOUT_CONFIG)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any dotted setting, e.g. pipeline.run_workers=16")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--state-dir")
    p.add_argument("--token", help="require this bearer token on every RPC")
    p.add_argument("--metrics-port", type=int)

    p = sub.add_parser("submit", help="run the jobs of a JSONL file, write trajectories")
    _client_flags(p)
    p.add_argument("file", help="JSONL: one {environment, task, sampling?, limits?, group?, "
                   "priority?, job_id?} per line")
    p.add_argument("--out", required=True, help="trajectories, one JSON line each (appended)")
    p.add_argument("--client-id", help="session id; re-run with the same id to resume "
                   "(default: derived from --out; env ROLLOUT_CLIENT_ID)")
    p.add_argument("--samples", type=int, default=1, help="jobs per line (a group)")
    p.add_argument("--finish-after", type=int, default=0,
                   help="cancel a group's other jobs once this many succeeded")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="live progress bars per stage")

    p = sub.add_parser("jobs", help="list, show or cancel jobs")
    jobs = p.add_subparsers(dest="jobs_command", required=True)
    q = jobs.add_parser("list")
    _client_flags(q)
    q.add_argument("--state", help="QUEUED, RUNNING, SUCCEEDED, FAILED or CANCELLED")
    q.add_argument("--group", default="")
    q.add_argument("--client-id", default="")
    q.add_argument("--limit", type=int, default=50)
    q = jobs.add_parser("get")
    _client_flags(q)
    q.add_argument("job_id")
    q.add_argument("--trajectory", action="store_true", help="include the trajectory")
    q = jobs.add_parser("cancel")
    _client_flags(q)
    q.add_argument("job_id", nargs="?", default="")
    q.add_argument("--group", default="")

    p = sub.add_parser("status", help="per-stage queues, latencies and job counts")
    _client_flags(p)

    for name, target in (("llm-serve", "serve a model over HTTP (vLLM-compatible routes)"),
                         ("quickstart", "start a server and run a small demo")):
        p = sub.add_parser(name, help=target, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES), add_help=False)
    p.add_argument("name", choices=BENCHES)
    p.add_argument("rest", nargs=argparse.REMAINDER)

    if importlib.util.find_spec("rollout.client.cli_backends") is not None:
        importlib.import_module("rollout.client.cli_backends").add_parser(sub)
    return parser


# ------------------------------------------------------------------ commands


def _serve(args: argparse.Namespace) -> int:
    from rollout.server.app import serve
    from rollout.server.config import load_config

    overrides = list(args.set)
    for flag, key in (("host", "server.host"), ("port", "server.port"),
                      ("state_dir", "server.state_dir"), ("token", "server.auth_token"),
                      ("metrics_port", "server.metrics_port")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = load_config(args.config, overrides)
    asyncio.run(serve(cfg))
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    mod = importlib.import_module(module)
    return int(mod.main(argv) or 0)


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "serve":
        return _serve(args)
    if cmd in _DELEGATED:
        return _delegate(_DELEGATED[cmd], args.rest)
    if cmd == "bench":
        return _delegate(f"rollout.server.bench.{args.name}", args.rest)
    from rollout.client import cli_commands

    settings = resolve_settings(args)
    if getattr(args, "handler", None) is not None:  # subcommands registered by plug-ins
        return int(args.handler(args, settings) or 0)
    if cmd == "submit":
        from rollout.client.cli_submit import run_submit

        return run_submit(args, settings)
    if cmd == "jobs":
        return asyncio.run(cli_commands.jobs(args, settings))
    if cmd == "status":
        return asyncio.run(cli_commands.status(settings))
    raise CliError("INVALID_ARGUMENT", "UNKNOWN_COMMAND", f"unknown command {cmd!r}")


_DELEGATED = {"llm-serve": "rollout.server.llm.http_server",
              "quickstart": "rollout.server.quickstart"}


def _delegated(argv: list[str]) -> tuple[str, list[str]] | None:
    """Commands whose flags belong to another module's parser: argparse's REMAINDER cannot
    pass a leading ``--flag`` through a subparser, so route them before parsing."""
    if argv and argv[0] in _DELEGATED and argv[1:2] != ["-h"]:
        return _DELEGATED[argv[0]], argv[1:]
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHES:
        return f"rollout.server.bench.{argv[1]}", argv[2:]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        delegated = _delegated(argv)
        if delegated is not None:
            return _delegate(*delegated)
        return _dispatch(build_parser().parse_args(argv))
    except RolloutError as err:
        return _fail(err.code.name, err.reason, err.message)
    except CliError as err:
        return _fail(err.code, err.reason, err.message)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # bad input files, server config errors
        code = "NOT_FOUND" if isinstance(exc, FileNotFoundError) else "INVALID_ARGUMENT"
        return _fail(code, str(getattr(exc, "reason", "BAD_INPUT")), str(exc))


def _fail(code: str, reason: str, message: str) -> int:
    print(f"error: {code} {reason}: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
