"""``rollout train dapo --config FILE``: the DAPO trainer against a server, or an in-process one.

Registered by ``entrypoints/cli.py`` through :func:`add_parser`. Nothing heavy is imported until the
command runs: torch and transformers come with the trainer (``rollout.trainer_adapters.dapo``),
and the in-process server only when ``--address`` (or ``[service] address``) is empty.

In-process mode starts the production server (``rollout.server.app.Server``) in this process
with one in-process transformers backend serving the model the trainer starts from, so the
trainer's pushed weights land in the engine that samples the next rollouts. With
``service.share_weights`` (the default) that engine serves the policy's own tensors instead of a
copy (:class:`InProcessWeights`): one model in memory and no checkpoint per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train a policy through the service (DAPO)")
    sub = p.add_subparsers(dest="train_command", required=True)
    q = sub.add_parser("dapo", help="DAPO: dynamic sampling, decoupled clip, token-mean loss",
                       description="Run the DAPO trainer. Without --address it starts an "
                       "in-process server with an in-process backend for the model.")
    q.add_argument("--config", help="TOML file (see rollout.trainer_adapters.dapo.run_config)")
    q.add_argument("--address", help="a running server; empty starts one in-process")
    q.add_argument("--token", help="bearer token of the server")
    q.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. run.steps=5 (value parsed as JSON, "
                   "else taken as a string)")
    q.set_defaults(handler=run_train)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set wants SECTION.KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def run_train(args: argparse.Namespace, settings: Any) -> int:
    from rollout.trainer_adapters.dapo.run_config import load_config

    overrides = parse_overrides(args.set)
    if args.address:
        overrides["service.address"] = args.address
    if args.token:
        overrides["service.token"] = args.token
    cfg = load_config(args.config, overrides)
    summary = asyncio.run(_train(cfg, Path(cfg.run.dir).resolve() / "server-state"))
    return 0 if summary is not None else 1


def resolve_model(path: str) -> Path:
    if path == "smollm2":
        from rollout.server.llm.smollm2 import smollm2_dir

        return smollm2_dir()
    model = Path(path).expanduser().resolve()
    if not (model / "config.json").is_file():
        raise ValueError(f"model.path {path!r} is not a Hugging Face checkpoint directory "
                         "(no config.json); use 'smollm2' for the embedded model")
    return model


async def _train(cfg: Any, state_dir: Path) -> Any:
    from rollout.trainer_adapters.dapo.trainer import DapoTrainer

    model_dir = await asyncio.to_thread(resolve_model, cfg.model.path)
    if cfg.service.address:
        return await DapoTrainer(cfg, cfg.service.address, model_dir=model_dir).run()
    server = await start_in_process_server(cfg, model_dir, state_dir)
    shared = InProcessWeights(server.llm) if cfg.service.share_weights else None
    try:
        return await DapoTrainer(cfg, server.address, model_dir=model_dir,
                                 shared=shared).run()
    finally:
        await server.stop(1.0)


class InProcessWeights:
    """The trainer's :class:`~rollout.trainer_adapters.dapo.weights.SharedWeights` for the
    in-process server: every engine of its pool that can serve the policy's tensors does."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.engines: list[Any] = []

    async def attach(self, model: Any) -> bool:
        engines = [self.pool.get(b.name).engine for b in self.pool.backends()]
        # One engine (what start_in_process_server builds): a refusal then leaves nothing
        # half-shared, and the checkpoint push takes over.
        if len(engines) != 1 or not hasattr(engines[0], "share_weights"):
            return False
        try:
            engines[0].share_weights(model)
        except ValueError:
            return False
        self.engines = engines
        return True

    async def pause(self) -> None:
        for engine in self.engines:
            await engine.pause(wait=True)
            engine.kv_store.clear()

    async def publish(self, version: int) -> None:
        self.pool.set_policy_version(version, [e.name for e in self.engines])
        for engine in self.engines:
            await engine.resume()


async def start_in_process_server(cfg: Any, model_dir: Path, state: Path) -> Any:
    """The production server on a free loopback port, state under the run directory."""
    from rollout.runtime.envs.short.handler import ShortAnswerHandler
    from rollout.runtime.handler import HandlerRegistry
    from rollout.server.app import Server
    from rollout.server.config import load_config as load_server_config

    workers = max(8, cfg.batch.group_size * max(cfg.batch.max_in_flight_groups,
                                                cfg.batch.groups_per_batch))
    device = cfg.model.device or ""
    backend = {"kind": "transformers", "model": str(model_dir)}
    if device:
        backend["device"] = device
    overrides = ["server.host=127.0.0.1", "server.port=0", f"server.state_dir={state}",
                 f"llm.backends=[{json.dumps(backend)}]", f"pipeline.run_workers={workers}",
                 f"pipeline.init_workers={workers}", f"pipeline.eval_workers={workers}",
                 *cfg.service.server_set]
    server_cfg = load_server_config(None, overrides, environ={})
    registry = HandlerRegistry.from_entry_points()
    if "short" not in registry.names():  # an install older than the entry point (not reinstalled)
        registry.register("short", ShortAnswerHandler)
    return await Server(server_cfg, registry=registry).start()
