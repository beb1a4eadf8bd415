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

import grpc

from rollout.client.aio import DEFAULT_ADDRESS
from rollout.client.errors import RolloutError

BENCHES = {
    "pipeline": "what the pipeline itself costs (jobs/s over gRPC vs in-process, memory) and "
                "whether stages overlap",
    "tools": "bash, IPython and sandbox latency inside bubblewrap, beside tmux and bare bwrap",
    "images": "container images as sandbox roots: cold fetch + unpack, warm image sandbox "
              "beside the plain one, concurrent first use of one image",
    "llm": "in-process engine: batching, KV reuse across turns, batched prefill, balancing",
    "swe": "swe INIT with a per-task environment: cold cache (builds the venv) vs warm "
           "(reuses it) vs no task environment, and EVAL of the gold patch",
    "scale": "an I/O-bound environment on a local multi-node Ray cluster: throughput and "
             "scaling efficiency on 1, 2, 4 nodes beside the single-process server; lost and "
             "duplicated trajectories with a node killed mid-run",
    "gateway": "model gateway: per-request overhead (first / last token) against the backend "
               "pool directly, and trainer tokens of a merged trajectory against one sequence "
               "per request",
    "soak": "clients that disconnect at random and a server SIGKILLed mid-run: the books "
            "(lost, duplicated after ack, re-issued ids, failed by restarts) must balance",
    "stalled": "sessions that stop reading while long trajectories finish: server RSS against "
               "the memory budget and a ceiling, and every trajectory delivered once on resume",
    "hostile": "well-behaved tenants beside a hostile one (gateway connection floods, ~8 MiB "
               "bodies, unread dashboard pages, cut clients, a SIGKILL): jobs/s and p99 "
               "gateway latency against a run without it, peak RSS and fds",
    "train-memory": "the DAPO trainer's update: peak RSS per step, each memory saving off "
                    "(baseline), one at a time and all on (shipped), each in its own process; "
                    "parameters must agree",
}
"""What ``rollout bench NAME`` runs (``benchmarks/NAME.py``, a dash in NAME an underscore in
the file's name); written here because the help must work where the server extra is not
installed."""


def bench_module(name: str) -> str:
    """The module ``rollout bench NAME`` runs."""
    return f"rollout.benchmarks.{name.replace('-', '_')}"


SERVER_EXTRA = {
    # import name -> distribution in pyproject's `server` extra (tests keep the two in step)
    "grpc_health": "grpcio-health-checking", "grpc_reflection": "grpcio-reflection",
    "prometheus_client": "prometheus-client", "transformers": "transformers",
    "tokenizers": "tokenizers", "safetensors": "safetensors", "gguf": "gguf",
    "accelerate": "accelerate", "jupyter_client": "jupyter-client", "ipykernel": "ipykernel",
    "aiohttp": "aiohttp", "sympy": "sympy", "matplotlib": "matplotlib",
    "numpy": "numpy", "pytest": "pytest", "pyseccomp": "pyseccomp", "jinja2": "jinja2",
    "packaging": "packaging", "yaml": "pyyaml",
}
SERVER_COMMANDS = ("serve", "quickstart", "llm-serve", "bench")


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

    # The defaults below are the server's embedded ones (server/config.py); they are spelled
    # out rather than imported because this parser must work without the server extra, and a
    # test compares them with the server's.
    p = sub.add_parser(
        "serve", help="run the service",
        description="Run the Rollout Service until Ctrl-C / SIGTERM (then it drains). Settings "
                    "resolve as: embedded defaults < TOML file < ROLLOUT_SECTION__KEY "
                    "environment < flags. One server per port and per state directory.",
        epilog="example: rollout serve --port 50052 --state-dir /scratch/rollout "
               "--set pipeline.run_workers=16")
    p.add_argument("--config", metavar="FILE",
                   help="TOML configuration with [server], [pipeline], [sandbox], [llm] "
                        "tables (env ROLLOUT_CONFIG; default: embedded defaults only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any dotted setting, e.g. pipeline.run_workers=16 or "
                        "'llm.backends=[]' (repeatable)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run stage work on a Ray cluster (host:port or 'auto'): one node agent "
                        "per node offering the custom resource rollout_node (cluster.ray)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="run stage work in N local processes (a private local Ray; "
                        "cluster.workers; default 0: in the server process)")
    p.add_argument("--host", help="interface to listen on (default 127.0.0.1; 0.0.0.0 for "
                                  "every interface)")
    p.add_argument("--port", type=int, help="gRPC port, 0 to 65535 (default 50051; 0 picks a "
                                            "free port)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="job store, sandbox workspaces and logs; locked by one server at a "
                        "time (default .rollout, in the current directory)")
    p.add_argument("--token", help="require this bearer token on every RPC (default: none)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus /metrics on this port (default 0: off)")
    p.add_argument("--gateway-port", type=int, metavar="PORT",
                   help="also serve the model gateway (OpenAI/Anthropic-compatible, per-job "
                        "keys) on this loopback port, for harnesses outside sandboxes "
                        "(default 0: off)")
    p.add_argument("--dashboard-port", type=int, metavar="PORT",
                   help="serve the web dashboard on this port of --host, with the same "
                        "tokens and tenancy (default -1: off; 0 picks a free port; "
                        "docs/dashboard.md)")
    p.add_argument("--drop-damaged-wal", action="store_true", default=None,
                   help="start even if the job store's write-ahead log is damaged in front "
                        "of committed jobs: drop the damaged tail and log which job ids it "
                        "held (store.drop_damaged_wal; default: refuse, STORE_WAL_DAMAGED)")

    p = sub.add_parser(
        "submit", help="run the jobs of a JSONL file, write trajectories",
        description="Run the jobs of a JSONL file and append each trajectory to --out. Job "
                    "ids: a line's own job_id, else <file-stem>-<line number> (math.jsonl line "
                    "3 -> math-3; with --samples N, math-3/0 .. math-3/N-1). Ids are "
                    "idempotency keys: submitting the same file again does not run jobs that "
                    "already ran under those ids (it says so, and how to fetch them with "
                    "`rollout jobs get ID --trajectory`); re-running the same command with "
                    "the same --out resumes after a crash. To run the jobs again, add --fresh "
                    "or --job-prefix PREFIX.")
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
    p.add_argument("--on-interrupt", choices=("ask", "cancel", "keep"), default="ask",
                   help="on Ctrl-C, the jobs this run submitted that are still unfinished: "
                        "ask (when a terminal can answer; otherwise keep and print how to "
                        "cancel), cancel them, or keep them running (re-run the command to "
                        "collect their trajectories)")
    ids = p.add_mutually_exclusive_group()
    ids.add_argument("--job-prefix", metavar="PREFIX",
                     help="ids become PREFIX-<line> (PREFIX-<job_id> for lines that name their "
                          "own id, and likewise for group ids); pass the same PREFIX again to "
                          "resume that run (default: the file's stem, lines' ids as written)")
    ids.add_argument("--fresh", action="store_true",
                     help="run every line again under new ids: a prefix made of the file's "
                          "stem, the time and a random tag (printed, for resuming)")

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
    q = jobs.add_parser("show", help="a job's trajectory turn by turn (raw token ids, or "
                                     "text with --text)")
    _client_flags(q)
    q.add_argument("job_id")
    q.add_argument("--text", action="store_true",
                   help="decode the tokens with the server's tokenizer (no model needed "
                        "here); generated tokens are shaded by probability")
    q = jobs.add_parser("cancel", help="cancel one job, a group's unfinished jobs, or every "
                                       "unfinished job of a client id (--all-mine)")
    _client_flags(q)
    q.add_argument("job_id", nargs="?", default="")
    q.add_argument("--group", default="")
    q.add_argument("--all-mine", action="store_true",
                   help="every queued or running job submitted under --client-id (the id "
                        "`rollout submit` prints; env ROLLOUT_CLIENT_ID)")
    q.add_argument("--client-id", help="with --all-mine: whose jobs (env ROLLOUT_CLIENT_ID)")

    p = sub.add_parser("status", help="per-stage queues, latencies, job counts and nodes")
    _client_flags(p)

    for name, target in (("llm-serve", "serve a model over HTTP (vLLM-compatible routes)"),
                         ("quickstart", "start a server and run a small demo"),
                         ("tasks", "task files: print job lines, `prepare FILE` (wheelhouse "
                                   "and per-task environments), `import-swebench`, "
                                   "`import-harbor`, `check-harbor`")):
        p = sub.add_parser(name, help=target, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    p = sub.add_parser(
        "bench", help="benchmarks: " + ", ".join(BENCHES),
        description="Benchmarks; each prints a table beside a baseline measured in the same "
                    "run. `rollout bench NAME --help` lists a benchmark's own flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks:\n" + "\n".join(f"  {name:<9} {text}"
                                            for name, text in BENCHES.items()))
    p.add_argument("name", choices=list(BENCHES), help="which benchmark to run")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="its flags")

    for plugin in ("rollout.entrypoints.backend_commands", "rollout.entrypoints.train"):
        if importlib.util.find_spec(plugin) is not None:
            importlib.import_module(plugin).add_parser(sub)
    return parser


# ------------------------------------------------------------------ commands


def require_server_extra(command: str) -> None:
    """Fail with the install command when the server's dependencies are absent (a trainer's
    client-only install), instead of a traceback from deep inside an import."""
    missing = [dist for name, dist in SERVER_EXTRA.items() if not _importable(name)]
    if missing:
        raise CliError("FAILED_PRECONDITION", "MISSING_EXTRA",
                       f"`rollout {command}` needs the server's dependencies, which this "
                       f"environment lacks ({', '.join(missing)}); install them with: "
                       "pip install 'rollout-service[server]'")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken or half-removed package
        return False


def _server_errors() -> tuple[type[BaseException], ...]:
    """The server's own error type, once a server command has imported it (the client never
    imports server code itself); ``except ()`` catches nothing."""
    errors = sys.modules.get("rollout.server.api.errors")
    return (errors.ServiceError,) if errors is not None else ()


def _serve(args: argparse.Namespace) -> int:
    require_server_extra("serve")
    from rollout.server.app import serve
    from rollout.server.config import load_config

    overrides = list(args.set)
    for flag, key in (("host", "server.host"), ("port", "server.port"),
                      ("state_dir", "server.state_dir"), ("token", "server.auth_token"),
                      ("metrics_port", "server.metrics_port"),
                      ("gateway_port", "server.gateway_port"),
                      ("dashboard_port", "server.dashboard_port"), ("ray", "cluster.ray"),
                      ("drop_damaged_wal", "store.drop_damaged_wal"),
                      ("workers", "cluster.workers")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = load_config(args.config, overrides)
    asyncio.run(serve(cfg))
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    if module.startswith(("rollout.server.", "rollout.runtime.", "rollout.benchmarks.",
                          "rollout.entrypoints.quickstart")):
        command = next((c for c, m in _DELEGATED.items() if m == module), "bench")
        require_server_extra(command)
    mod = importlib.import_module(module)
    return int(mod.main(argv) or 0)


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "serve":
        return _serve(args)
    if cmd in _DELEGATED:
        return _delegate(_DELEGATED[cmd], args.rest)
    if cmd == "bench":
        return _delegate(bench_module(args.name), args.rest)
    from rollout.entrypoints import job_commands

    check_flags(args)
    settings = resolve_settings(args)
    try:
        if getattr(args, "handler", None) is not None:  # subcommands registered by plug-ins
            return int(args.handler(args, settings) or 0)
        if cmd == "submit":
            from rollout.entrypoints.submit import run_submit

            return run_submit(args, settings)
        if cmd == "jobs":
            return asyncio.run(job_commands.jobs(args, settings))
        if cmd == "status":
            return asyncio.run(job_commands.status(settings))
    except RolloutError as err:
        raise explain(err, settings) from None
    raise CliError("INVALID_ARGUMENT", "UNKNOWN_COMMAND", f"unknown command {cmd!r}")


_AT_LEAST = {"limit": 1, "samples": 1, "finish_after": 0}
"""Numeric flags and their smallest sensible value, checked once before anything is sent
(a bad one would otherwise print nothing, or be rejected once per job)."""


def check_flags(args: argparse.Namespace) -> None:
    for flag, low in _AT_LEAST.items():
        value = getattr(args, flag, None)
        if isinstance(value, int) and value < low:
            name = "--" + flag.replace("_", "-")
            raise CliError("INVALID_ARGUMENT", "INVALID_FLAG",
                           f"{name} must be at least {low}, got {value}")
    samples, finish_after = getattr(args, "samples", 1), getattr(args, "finish_after", 0)
    if finish_after and finish_after > samples:
        raise CliError("INVALID_ARGUMENT", "INVALID_FLAG",
                       f"--finish-after {finish_after} can never be reached with --samples "
                       f"{samples}: give at most {samples} (0: run every sample)")


def explain(err: RolloutError, settings: ClientSettings) -> CliError:
    """The failures a user fixes on their side, said with the fix: no server at the address,
    a token missing or wrong. Anything else is printed as the server said it."""
    if err.code == grpc.StatusCode.UNAVAILABLE and not err.from_server:
        return CliError("UNAVAILABLE", "SERVER_UNREACHABLE",
                        f"no rollout server answers at {settings.address}; start one with "
                        "`rollout serve`, or point --address (or ROLLOUT_ADDRESS) at a running "
                        f"one ({err.message})")
    if err.reason in ("MISSING_TOKEN", "MALFORMED_TOKEN", "BAD_TOKEN"):
        where = "" if settings.token is None else " (the one given was refused)"
        return CliError(err.code.name, err.reason,
                        f"{err.message}: the server at {settings.address} requires a token"
                        f"{where}; pass --token TOKEN (or set ROLLOUT_TOKEN, or `token` in the "
                        "[client] table of --config)")
    return CliError(err.code.name, err.reason, err.message)


_DELEGATED = {"llm-serve": "rollout.server.llm.http_server",
              "quickstart": "rollout.entrypoints.quickstart",
              "tasks": "rollout.runtime.tasksets.shipped"}


def _delegated(argv: list[str]) -> tuple[str, list[str]] | None:
    """Commands whose flags belong to another module's parser: argparse's REMAINDER cannot
    pass a leading ``--flag`` through a subparser, so route them before parsing."""
    if argv and argv[0] in _DELEGATED and argv[1:2] != ["-h"]:
        return _DELEGATED[argv[0]], argv[1:]
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHES:
        return bench_module(argv[1]), argv[2:]
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
    except _server_errors() as err:  # start-up failures: port in use, state dir locked, …
        return _fail(err.code.name, err.reason, str(err))  # type: ignore[attr-defined]
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:  # e.g. torch, which the server extra leaves to the user
        return _fail("FAILED_PRECONDITION", "MISSING_DEPENDENCY",
                     f"{exc}; install it with: pip install {exc.name or 'the missing package'}"
                     " (or pip install 'rollout-service[server]')")
    except (ValueError, OSError) as exc:  # bad input files, server config errors
        code = "NOT_FOUND" if isinstance(exc, FileNotFoundError) else "INVALID_ARGUMENT"
        return _fail(code, str(getattr(exc, "reason", "BAD_INPUT")), str(exc))


def _fail(code: str, reason: str, message: str) -> int:
    print(f"error: {code} {reason}: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
