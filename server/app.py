"""Server bootstrap in one place: gRPC server, health, reflection, interceptors, shutdown.

``Server`` owns everything a running service holds (job store, scheduler, LLM pool, sandbox
runtime, metrics endpoint) and tears it down in reverse order. Shutdown is graceful: health
flips to NOT_SERVING first so load balancers stop sending work, then in-flight RPCs get
``grace_s`` to finish. Jobs still running are not lost: they are in the store and run again on
the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import sqlite3
import tempfile
from pathlib import Path
from typing import Any, Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rollout.runtime.envs.common import DATA_DIR, set_host_path_roots
from rollout.runtime.envs.swe.taskenv import set_sandbox_runtime
from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.types import InvalidArgument
from rollout.server.api import reflection as rollout_reflection
from rollout.server.api.interceptors import ServiceInterceptor
from rollout.server.api.servicer import RolloutServicer
from rollout.server.api.services import (
    ROLLOUT_SERVICE_NAME,
    add_backend_service,
    add_rollout_service,
)
from rollout.server.config import Config
from rollout.server.scheduler import PipelineConfig, Scheduler
from rollout.server.startup import (
    StartupError,
    StateDirLock,
    check_port_free,
    check_port_range,
    port_in_use,
    who_listens,
)
from rollout.server.store import STORE_FILE, JobStore, check_store_file
from rollout.server.store.file import damaged as store_damaged
from rollout.server.tenancy.auth import Authenticator, server_credentials

log = logging.getLogger(__name__)

SERVICE_NAME = ROLLOUT_SERVICE_NAME


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options both sides use; the client's keepalive must not ping more often than allowed."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class Server:
    """A running Rollout Service. Use ``await Server.start(cfg)`` and ``await server.stop()``."""

    def __init__(self, cfg: Config, registry: HandlerRegistry | None = None,
                 llm: Any = None, sandbox_factory: Any = None) -> None:
        self.cfg = cfg
        self.registry = registry or HandlerRegistry.from_entry_points()
        self.llm = llm
        self.sandbox_factory = sandbox_factory
        self.port = 0
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self.store: JobStore | None = None
        self.scheduler: Scheduler | None = None
        self._metrics_server: Any = None
        self._owns_llm = False
        self._prev_roots: Any = None
        self._prev_runtime: str | None = None
        self._lock: StateDirLock | None = None
        self.gateway: Any = None
        """``server.gateway.Gateway``: harness environments' model endpoint."""
        self.cluster: Any = None
        """``server.cluster.ray_backend.RayCluster`` with ``--ray`` / ``--workers``."""
        self.dashboard: Any = None
        """``server.dashboard.Dashboard`` when ``server.dashboard_port`` is not -1."""

    @property
    def address(self) -> str:
        return f"{self.cfg.server.host}:{self.port}"

    async def start(self) -> Server:
        """Claim the state directory and the port, then start; raises ``StartupError`` (one
        line naming what to change) when either is taken or unusable, having released
        whatever it had claimed."""
        cfg = self.cfg
        check_port_range(cfg.server.port)
        check_port_range(cfg.server.metrics_port, "server.metrics_port", "--metrics-port")
        check_port_range(cfg.server.gateway_port, "server.gateway_port", "--gateway-port")
        if cfg.server.dashboard_port != -1:
            check_port_range(cfg.server.dashboard_port, "server.dashboard_port",
                             "--dashboard-port")
        # The lock comes before anything reads or reaps the state directory: a second server
        # must not "recover" (and so run again) the jobs the first one is running.
        self._lock = StateDirLock.acquire(cfg.state_path)
        try:
            await self._start()
        except BaseException:
            with contextlib.suppress(Exception):  # the start-up error is the one to report
                await self.stop(0)
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            raise
        return self

    async def _start(self) -> None:
        cfg = self.cfg
        state = cfg.state_path
        # Answer "port in use" now, not after a model has loaded for a minute.
        try:
            check_port_free(cfg.server.host, cfg.server.port)
        except StartupError as exc:
            if exc.reason != "PORT_IN_USE":
                raise
            holder = await who_listens(cfg.server.host, cfg.server.port, SERVICE_NAME)
            raise port_in_use(cfg.server.host, cfg.server.port, holder=holder) from None
        if cfg.server.metrics_port:
            check_port_free(cfg.server.metrics_host, cfg.server.metrics_port,
                            "the metrics endpoint", "--metrics-port")
        if cfg.server.dashboard_port > 0:
            check_port_free(cfg.server.host, cfg.server.dashboard_port, "the dashboard",
                            "--dashboard-port")
        # A corrupt or foreign store is refused before a model loads for a minute.
        await asyncio.to_thread(functools.partial(
            check_store_file, state / STORE_FILE, drop_damaged_wal=cfg.store.drop_damaged_wal))
        # Host paths a task may name (a swe task's repo_source): operator-chosen roots only.
        self._prev_roots = set_host_path_roots(
            cfg.server.task_path_roots or [DATA_DIR, state / "tasks"])
        # A task that names its own image is refused at submit on bwrap, not in INIT.
        self._prev_runtime = set_sandbox_runtime(cfg.sandbox.runtime)
        if self.sandbox_factory is None:
            self.sandbox_factory = build_sandbox_factory(cfg)
            pool = sandbox_pool_of(self.sandbox_factory)
            if pool is not None and not (cfg.cluster.ray or cfg.cluster.workers):
                # Fill now, so the first jobs find ready sandboxes (with node agents the jobs'
                # sandboxes are theirs: each agent's pool fills at its first job).
                pool.start()
        if self.llm is None and cfg.llm.backends:
            from rollout.server.llm.factory import build_pool  # heavy (torch): only when configured

            self.llm = await build_pool(cfg)
            self._owns_llm = True
        nodes = None
        if cfg.cluster.ray or cfg.cluster.workers:
            # Only here is Ray imported: a server without --ray/--workers never loads it.
            from rollout.server.cluster.agent import load_handler
            from rollout.server.cluster.node import NodeSet

            try:
                from rollout.server.cluster.ray_backend import RayCluster
            except ImportError as exc:
                raise InvalidArgument(
                    f"--ray / --workers need Ray ({exc}): pip install 'rollout-service[ray]'",
                    "BAD_CONFIG", "cluster.ray") from exc

            for name, path in cfg.cluster.handlers.items():  # validate as the nodes will run
                self.registry.register(name, load_handler(path))
            nodes = NodeSet()
            self.cluster = await RayCluster(nodes, cfg).start()
        self.store = JobStore(state / STORE_FILE, synchronous=cfg.store.synchronous)
        await self.store.open()
        self.scheduler = Scheduler(
            self.store, self.registry, llm=self.llm, sandbox_factory=self.sandbox_factory,
            nodes=nodes, config=PipelineConfig(
                init_workers=cfg.pipeline.init_workers, run_workers=cfg.pipeline.run_workers,
                eval_workers=cfg.pipeline.eval_workers,
                stage_queue_size=cfg.pipeline.stage_queue_size,
                max_pending_jobs=cfg.pipeline.max_pending_jobs,
                max_in_flight_per_client=cfg.pipeline.max_in_flight_per_client,
                cleanup_deadline_s=cfg.pipeline.cleanup_deadline_s,
                retention_s=cfg.pipeline.retention_s,
                job_retention_s=cfg.pipeline.job_retention_s,
                prune_interval_s=cfg.pipeline.prune_interval_s,
                delivery_memory_bytes=cfg.pipeline.delivery_memory_bytes,
                session_memory_bytes=cfg.pipeline.session_memory_bytes))
        from rollout.server.gateway import Gateway

        try:
            self.gateway = await Gateway(
                state, tcp_host=cfg.server.gateway_host,
                tcp_port=cfg.server.gateway_port or None).start()
        except OSError:
            raise port_in_use(cfg.server.gateway_host, cfg.server.gateway_port,
                              "the model gateway", "--gateway-port") from None
        self.scheduler.gateway = self.gateway
        try:
            await self.scheduler.start()  # reads every live row
        except sqlite3.DatabaseError as exc:  # damage quick_check missed: still one line
            raise store_damaged(state / STORE_FILE, exc) from None

        # Credentials first: a bad certificate path or client entry fails before we listen.
        tls = server_credentials(cfg.server.tls_cert_file, cfg.server.tls_key_file,
                                 cfg.server.tls_client_ca_file)
        server = grpc.aio.server(
            interceptors=[ServiceInterceptor(authenticator=Authenticator(
                cfg.server.auth_token, cfg.server.clients))],
            # gRPC turns SO_REUSEPORT on by default: a second server on a taken port would
            # start and receive every other request. Off, the bind fails as it should.
            options=[*channel_options(cfg.server.max_message_bytes), ("grpc.so_reuseport", 0)])
        names = [add_rollout_service(server, RolloutServicer(
            self.scheduler, heartbeat_s=cfg.server.heartbeat_s,
            min_heartbeat_s=cfg.server.min_heartbeat_s,
            max_page_bytes=cfg.server.max_message_bytes // 2)), health.SERVICE_NAME]
        if self.llm is not None and hasattr(self.llm, "add"):
            names.append(add_backend_service(server, self.llm))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if cfg.server.reflection:
            # Our own reflection: v1 beside v1alpha, and descriptors that keep their comments.
            rollout_reflection.enable(server, names)
        try:
            self.port = (server.add_secure_port(f"{cfg.server.host}:{cfg.server.port}", tls)
                         if tls is not None else
                         server.add_insecure_port(f"{cfg.server.host}:{cfg.server.port}"))
        except RuntimeError:  # "Failed to bind": taken since check_port_free looked
            raise port_in_use(cfg.server.host, cfg.server.port) from None
        if self.port == 0:
            raise StartupError(grpc.StatusCode.INVALID_ARGUMENT, "CANNOT_LISTEN",
                               f"cannot listen on {cfg.server.host}:{cfg.server.port}; check "
                               "--host and --port", "server.host")
        await server.start()
        self._grpc = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self._lock is not None:
            self._lock.record_address(self.address)
        if cfg.server.metrics_port:
            try:
                self._metrics_server = self.scheduler.serve_metrics(
                    cfg.server.metrics_host, cfg.server.metrics_port)
            except OSError:
                raise port_in_use(cfg.server.metrics_host, cfg.server.metrics_port,
                                  "the metrics endpoint", "--metrics-port") from None
        if cfg.server.dashboard_port != -1:
            from rollout.server.dashboard import Dashboard  # aiohttp + jinja2: only when asked

            dashboard = Dashboard(self.scheduler, Authenticator(cfg.server.auth_token,
                                                                cfg.server.clients),
                                  tls_cert_file=cfg.server.tls_cert_file,
                                  tls_key_file=cfg.server.tls_key_file,
                                  allow_open=cfg.server.dashboard_allow_open)
            try:
                await dashboard.start(cfg.server.host, cfg.server.dashboard_port)
            except OSError:
                raise port_in_use(cfg.server.host, cfg.server.dashboard_port, "the dashboard",
                                  "--dashboard-port") from None
            self.dashboard = dashboard
        log.info("rollout service listening on %s (state in %s)", self.address, state)

    async def stop(self, grace_s: float | None = None) -> None:
        grace = self.cfg.server.grace_s if grace_s is None else grace_s
        await self._health.enter_graceful_shutdown()  # every service -> NOT_SERVING
        if self.dashboard is not None:  # its live pages end; nothing else depends on it
            await self.dashboard.stop()
            self.dashboard = None
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self.scheduler is not None:
            await self.scheduler.stop(grace)
        if self.gateway is not None:
            with contextlib.suppress(Exception):
                await self.gateway.stop()
            self.gateway = None
        if self.sandbox_factory is not None:
            from rollout.runtime.sandbox import settle_abandoned

            if (pool := sandbox_pool_of(self.sandbox_factory)) is not None:
                await pool.close()  # a stopped server holds no ready sandbox either
            # INITs cancelled while their sandbox was being made: the making thread tears
            # it down; wait for that, so a stopped server holds no mount.
            if left := await settle_abandoned(self.cfg.pipeline.cleanup_deadline_s):
                log.warning("%d cancelled sandbox creations still tearing down at stop", left)
        if self.store is not None:
            await self.store.close()
        if self.cluster is not None:  # after the scheduler released what the nodes held
            with contextlib.suppress(Exception):
                await self.cluster.stop()
            self.cluster = None
            # A worker killed by Ray (ray.kill is SIGKILL) cannot unmount its sandboxes, and
            # its replacement may start before the dead one's locks are gone.
            for root in local_node_sandbox_roots(self.cfg):
                await asyncio.to_thread(reap_stale_logged, root)
        if self._metrics_server is not None:
            with contextlib.suppress(Exception):
                self._metrics_server[0].shutdown()
        if self._owns_llm and self.llm is not None:
            await self.llm.close()
        set_host_path_roots(self._prev_roots)
        set_sandbox_runtime(self._prev_runtime)
        if self._lock is not None:  # last: the next server may now recover what we left
            self._lock.release()
            self._lock = None

    async def wait(self) -> None:
        if self._grpc is not None:
            await self._grpc.wait_for_termination()


def build_sandbox_factory(cfg: Config) -> Any:
    """The configured sandbox runtime as a ``JobContext.sandbox_factory``; also reaps what a
    crashed predecessor left behind under the state directory."""
    from rollout.runtime.sandbox import SandboxConfig, SandboxLimits, create_sandbox
    from rollout.runtime.sandbox.base import ImageSettings, SandboxError
    from rollout.runtime.sandbox.images import is_image_ref, parse_image_ref
    from rollout.runtime.sandbox.images.egress import check_entries

    image = cfg.sandbox.image or None
    ceilings = SandboxLimits(address_space_bytes=cfg.sandbox.max_address_space_bytes,
                             processes=cfg.sandbox.max_processes,
                             open_files=cfg.sandbox.max_open_files)
    sb = cfg.sandbox
    images = ImageSettings(cache_dir=sb.image_cache, budget_bytes=sb.image_cache_bytes,
                           max_image_bytes=sb.image_max_bytes,
                           setuid="refuse" if sb.image_setuid == "refuse" else "strip",
                           authfile=sb.image_authfile, registries_conf=sb.image_registries_conf,
                           timeout_s=sb.image_timeout_s, build_timeout_s=sb.image_build_timeout_s,
                           rootless_root=_rootless_root(sb.image_rootless_root),
                           build_network=("allowlist" if sb.image_build_network == "allowlist"
                                          else "host"),
                           build_hosts=check_entries(sb.image_build_hosts))
    if image and is_image_ref(image):
        try:  # a bad reference stops the start, not every job
            parse_image_ref(image)
        except SandboxError as e:
            raise InvalidArgument(f"config key 'sandbox.image': {e}", "BAD_CONFIG",
                                  "sandbox.image") from e
    if cfg.sandbox.runtime == "bwrap":
        reference = bool(image and is_image_ref(image))
        sb_cfg = SandboxConfig(runtime="bwrap", state_dir=cfg.state_path,
                               rootfs=Path(image) if image and not reference else None,
                               image=image if reference else None, images=images,
                               host_view="host" if cfg.sandbox.host_view == "host" else "minimal",
                               visible_paths=tuple(cfg.sandbox.visible_paths),
                               disk_bytes=cfg.sandbox.disk_bytes,
                               memory_bytes=cfg.sandbox.memory_bytes, seccomp=cfg.sandbox.seccomp,
                               max_limits=ceilings,
                               verifier_hosts=check_entries(cfg.sandbox.verifier_hosts))
    elif cfg.sandbox.runtime == "apptainer":
        sb_cfg = SandboxConfig(runtime="apptainer", state_dir=cfg.state_path, image=image,
                               images=images,
                               host_view="host" if cfg.sandbox.host_view == "host" else "minimal",
                               disk_bytes=cfg.sandbox.disk_bytes,
                               memory_bytes=cfg.sandbox.memory_bytes, max_limits=ceilings,
                               verifier_hosts=check_entries(cfg.sandbox.verifier_hosts))
    else:
        raise InvalidArgument(f"sandbox.runtime must be 'bwrap' or 'apptainer', got "
                              f"{cfg.sandbox.runtime!r}", "BAD_CONFIG", "sandbox.runtime")
    reap_stale_logged(sb_cfg.sandboxes_dir)
    if sb_cfg.runtime == "bwrap" and cfg.sandbox.pool_size > 0 and image is None:
        from rollout.runtime.sandbox.pool import PoolSettings, SandboxPool

        pool = SandboxPool(sb_cfg, PoolSettings(size=cfg.sandbox.pool_size,
                                                memory_bytes=cfg.sandbox.pool_memory_bytes,
                                                idle_s=cfg.sandbox.pool_idle_s,
                                                tools=tuple(cfg.sandbox.pool_tools)))
        return functools.partial(create_sandbox, sb_cfg, pool=pool)
    return functools.partial(create_sandbox, sb_cfg)


def _rootless_root(value: str) -> Literal["auto", "overlay", "copy"]:
    """``sandbox.image_rootless_root`` (checked when the config loads) as ImageSettings types it."""
    return "copy" if value == "copy" else "overlay" if value == "overlay" else "auto"


def sandbox_pool_of(factory: Any) -> Any:
    """The warm pool a :func:`build_sandbox_factory` factory takes from, or None."""
    return factory.keywords.get("pool") if isinstance(factory, functools.partial) else None


def reap_stale_logged(root: Path) -> None:
    """The start-up (and node) sweep of ``runtime.sandbox.reap_stale``: it logs what it
    removed; a failure is logged, never fatal (stale leftovers must not stop a server)."""
    from rollout.runtime.sandbox import reap_stale

    try:
        report = reap_stale(root)
    except Exception:
        log.exception("sweeping stale sandboxes under %s failed", root)
        return
    if report.live:
        log.info("%d sandboxes under %s belong to a live process; left alone",
                 len(report.live), root)


def local_node_sandbox_roots(cfg: Config) -> list[Path]:
    """The sandbox roots of ``--workers`` node agents (processes on this host), which the
    server can sweep itself once they are gone. ``--ray`` nodes may be other hosts: each
    new agent sweeps its own root at start instead (``NodeAgent`` builds its factory here)."""
    if not cfg.cluster.workers:
        return []
    # As ray_backend.RayCluster places them: <node_state_dir or $TMPDIR/rollout-nodes>/<name>.
    base = Path(cfg.cluster.node_state_dir or os.path.join(tempfile.gettempdir(),
                                                           "rollout-nodes"))
    return [base / f"worker-{i}" / "sandboxes" for i in range(cfg.cluster.workers)]


async def serve(cfg: Config) -> None:
    """Run until SIGINT/SIGTERM, then shut down gracefully."""
    server = await Server(cfg).start()
    # What start-up made (imports, tokenizers, config, the server's own objects) lives as long as
    # the process: moving it out of the collector's reach keeps each later collection short, which
    # is the gateway's p99 tail.
    gc.freeze()
    dashboard = f"; dashboard {server.dashboard.url}" if server.dashboard is not None else ""
    print(f"rollout service listening on {server.address}  (state: {cfg.state_path}{dashboard})",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("shutting down: health NOT_SERVING, draining RPCs…", flush=True)
    await server.stop()
