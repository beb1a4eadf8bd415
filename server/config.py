"""Server configuration: embedded defaults < TOML file < ROLLOUT_* environment < flags.

Every setting has one dotted name, used the same way everywhere::

    # rollout.toml
    [server]
    port = 50051
    [pipeline]
    run_workers = 16
    [[llm.backends]]
    kind = "vllm"
    url = "http://gpu-node-1:8000"

    ROLLOUT_PIPELINE__RUN_WORKERS=16 rollout serve      # environment: SECTION__KEY
    rollout serve --set pipeline.run_workers=16         # flag: any dotted key
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout.runtime.types import InvalidArgument

ENV_PREFIX = "ROLLOUT_"


@dataclass
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 50051
    """0 to 65535; 0 picks a free port (tests). Never shared: a taken port fails start-up."""
    state_dir: str = ".rollout"
    """SQLite job store, sandbox workspaces and logs live here. One server at a time holds it
    (an exclusive lock on ``server.lock``, which names the holder's pid and address)."""
    auth_token: str = ""
    """When set, every RPC must carry ``authorization: Bearer <token>``. This single token is
    an operator credential: admin role, may act as any client id (see ``clients`` to keep
    tenants apart)."""
    clients: list[dict[str, Any]] = field(default_factory=list)
    """Per-client credentials, each bound to one client id (``server/tenancy/auth.py``):
    ``{client_id = "a", token = "..." | token_sha256 = "<hex>" | tls_identity = "CN or SAN",
    roles = ["admin"]}``. A bound client sees, acknowledges and cancels only its own jobs;
    ``admin`` allows BackendService."""
    tls_cert_file: str = ""
    """PEM certificate chain of the gRPC port; with ``tls_key_file`` the port speaks TLS."""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    """PEM CA bundle; when set, clients must present a certificate it signed (mTLS), and the
    certificate's CN / SANs can be mapped to client ids with ``clients[].tls_identity``."""
    reflection: bool = True
    """Serve gRPC server reflection (open without a credential, like health)."""
    min_heartbeat_s: float = 0.1
    """Shortest heartbeat interval a session may ask for (0 = no heartbeats stays allowed):
    each heartbeat is a frame built and sent, so a 1 ns interval is a busy loop."""
    task_path_roots: list[str] = field(default_factory=list)
    """Directories a task may name host paths in (a swe task's ``repo_source``); symlinks are
    resolved first. Empty = the shipped data dir and ``<state_dir>/tasks``."""
    metrics_port: int = 0
    """Prometheus metrics over HTTP on this port; 0 disables."""
    metrics_host: str = "127.0.0.1"
    gateway_port: int = 0
    """Also serve the model gateway (docs/model-gateway.md) over TCP on this port, for
    harnesses outside sandboxes; 0 disables (sandboxed harnesses use their job's Unix
    socket). Every request still needs its job's key."""
    gateway_host: str = "127.0.0.1"
    dashboard_port: int = -1
    """The web dashboard (docs/dashboard.md) on this port of ``host``, with the same tokens and
    tenancy as the gRPC port (and its TLS certificate, when set); -1 (the default) disables it,
    0 picks a free port (the start-up line names it)."""
    dashboard_allow_open: bool = False
    """Serve the dashboard without credentials on a non-loopback ``host``. Off (the default):
    such a start is refused, since anyone who can reach the port would see every job."""
    grace_s: float = 10.0
    """On shutdown: health flips to NOT_SERVING, then RPCs get this long to finish."""
    max_message_bytes: int = 64 << 20
    """Largest gRPC message either side accepts (trajectories can be large)."""
    heartbeat_s: float = 10.0


@dataclass
class PipelineSection:
    init_workers: int = 8
    run_workers: int = 32
    eval_workers: int = 8
    stage_queue_size: int = 1024
    """Jobs waiting between two stages; a full queue holds the upstream worker back."""
    max_pending_jobs: int = 100_000
    """Unfinished jobs the server accepts before answering RESOURCE_EXHAUSTED."""
    max_in_flight_per_client: int = 0
    """Unfinished jobs one client id may have; 0 = only the server-wide cap."""
    cleanup_deadline_s: float = 30.0
    """Bound on each clean-up step of an ending job (handler cleanup, sandbox, LLM session)."""
    retention_s: float = 86_400.0
    """Seconds a finished job's trajectory is kept after its client ACKNOWLEDGED it; then the
    trajectory, its delivery and the job's transition history are deleted (GetJob still
    reports state and reward, without a trajectory). Unacknowledged results are never deleted.
    0 = keep everything forever."""
    job_retention_s: float = 604_800.0
    """Seconds the remaining job row (state, reward, error, timestamps) is kept after its
    trajectory was pruned; then GetJob answers NOT_FOUND and the id can be reused. 0 = forever."""
    prune_interval_s: float = 60.0
    """How often the retention pass runs (in batches of 1000 rows, beside normal writes)."""
    delivery_memory_bytes: int = 1 << 30
    """Memory that finished trajectories not yet written to their clients may take, all
    sessions together (estimated as decoded objects, about ten times their encoded size);
    beyond it they wait in the store and are read back as clients take what they hold."""
    session_memory_bytes: int = 256 << 20
    """The most of ``delivery_memory_bytes`` one session may hold: a client that stops
    reading holds at most this much server memory."""


@dataclass
class StoreSection:
    synchronous: str = "FULL"
    """SQLite ``PRAGMA synchronous`` of the job store (WAL mode). ``FULL`` (default): every
    commit is on disk before anyone hears of it, so even a power cut or an OS crash cannot take
    back an announced delivery. ``NORMAL``: commits skip the fsync of the write-ahead log; a
    process crash still loses nothing, but a power cut or OS crash can lose the last
    transactions (never corrupting the store): a trajectory already sent may then be lost from
    the store, its job runs again, and the trainer receives it a second time, possibly under a
    delivery id it has already seen."""
    drop_damaged_wal: bool = False
    """Start even when the write-ahead log is damaged in front of committed transactions
    (``STORE_WAL_DAMAGED``): the log is cut to what SQLite can replay, the whole log is kept
    beside the store, and the server logs how many frames and which job ids it dropped. Off:
    such a start is refused (``--drop-damaged-wal`` turns it on for one start)."""


HOST_VIEWS = ("minimal", "host")
"""What ``sandbox.host_view`` accepts."""
SYNCHRONOUS_MODES = ("FULL", "NORMAL")
"""What ``store.synchronous`` accepts; ``OFF`` is not offered (a power cut can corrupt the
store)."""


@dataclass
class SandboxSection:
    runtime: str = "bwrap"
    """``bwrap`` (default) or ``apptainer`` (the ``apptainer`` CLI, else ``singularity``,
    called directly with deadlines)."""
    image: str = ""
    """Rootfs directory (bwrap) or SIF/directory image (apptainer), or an image reference
    (``docker://``, ``oci:``, ``oci-archive:``, ``docker-archive:``; docs/images.md) whose
    cached root every sandbox runs on; empty = a root built from the host as ``host_view``
    says. A job's own image (a swe task's ``spec.image``) wins."""
    image_cache: str = ""
    """Where images are cached ('' = ``$ROLLOUT_IMAGE_CACHE`` or ``~/.cache/rollout/images``,
    where ``rollout tasks prepare`` puts them)."""
    image_cache_bytes: int = 32 << 30
    """Total unpacked size the image cache keeps; unused images are evicted past it."""
    image_max_bytes: int = 8 << 30
    """Largest unpacked size of one image; a bigger one fails its jobs in INIT."""
    image_setuid: str = "strip"
    """setuid/setgid files in an image: ``strip`` the bits (default) or ``refuse`` the image."""
    image_authfile: str = ""
    """A containers-auth.json for private registries (default: skopeo's own lookup)."""
    image_registries_conf: str = ""
    """A registries.conf (mirrors, insecure registries) instead of the user's."""
    image_timeout_s: float = 1800.0
    """Deadline of one image fetch or unpack."""
    image_build_timeout_s: float = 3600.0
    """Deadline of one Dockerfile build."""
    image_build_network: str = "host"
    """The network of a Dockerfile build's ``RUN`` steps: ``host`` (the server's) or
    ``allowlist`` (only the registries of registries.conf and ``image_build_hosts``; a
    rootless server needs its subordinate ids for it; docs/images.md)."""
    image_build_hosts: list[str] = field(default_factory=list)
    """With ``image_build_network = "allowlist"``: the package registries builds may reach
    (``deb.debian.org``, ``pypi.org:443``, ``*.pythonhosted.org``)."""
    verifier_hosts: list[str] = field(default_factory=list)
    """Hosts a task's verifier may reach (a Harbor task's ``tests/test.sh`` that installs its
    test tools: ``astral.sh``, ``github.com``, ``*.githubusercontent.com``, ``pypi.org``,
    ``files.pythonhosted.org``), through an allow-listing proxy, over HTTP(S) only; the agent
    never gets a network. Empty (default): the verifier's requests are refused, and its
    reward's info names each host it tried (docs/harbor.md)."""
    image_rootless_root: str = "auto"
    """A rootless server's image roots: ``auto`` (an overlay per sandbox, falling back to a
    private copy of the image where the kernel refuses a rootless overlay), ``overlay`` or
    ``copy`` (docs/images.md)."""
    host_view: str = "minimal"
    """bwrap without ``image``: ``minimal`` (default) shows a sandbox only what a job needs
    (system trees, an allow-listed /etc, the interpreter, its task environment, and
    ``visible_paths``); ``host`` shows the whole host root read-only but a few hidden paths,
    task files, data sets and checkouts included: only for trusted workloads."""
    visible_paths: list[str] = field(default_factory=list)
    """bwrap, minimal view: more host paths bound read-only at the same path (e.g.
    ``["/opt/toolchain"]``); the state dir and the service's own package stay covered."""
    disk_bytes: int = 2 << 30
    """bwrap, server running as root: size of each sandbox's tmpfs (/workspace, /tmp and
    /.sandbox together); a job writing more gets ENOSPC. 0 = no quota."""
    memory_bytes: int = 0
    """bwrap: memory cap of all sandboxes together (a memory cgroup, where one is writable).
    0 = half of physical memory; -1 = no cap."""
    seccomp: bool = True
    """bwrap: a seccomp filter (no namespaces, mounts, kernel modules, bpf, keyrings)."""
    max_address_space_bytes: int = 32 << 30
    """The most RLIMIT_AS (per process) a job may ask for (a harness preset's ``[limits]``;
    the default is 4 GiB). An address-space limit is not memory use: the memory cap above
    bounds that."""
    max_processes: int = 4096
    """The most RLIMIT_NPROC (processes and threads of a sandbox) a job may ask for (the
    default is 256)."""
    max_open_files: int = 65536
    """The most RLIMIT_NOFILE a job may ask for (the default is 1024)."""
    pool_size: int = 0
    """bwrap: ready sandboxes kept per sandbox shape (made, with their first launch parked,
    before a job asks), so INIT takes one instead of making one; 0 = no pool. Only plain
    sandboxes are pooled (no image, no binds). See docs/operating.md "Warm sandbox pool"."""
    pool_memory_bytes: int = 512 << 20
    """bwrap: no new pooled sandbox while the ready ones' processes hold this much RSS."""
    pool_idle_s: float = 60.0
    """bwrap: a pooled shape nobody took for this long is emptied until a job asks again."""
    pool_tools: list[str] = field(default_factory=list)
    """bwrap: tools started in each pooled sandbox before a job takes it, ``bash`` and/or
    ``python`` (the IPython kernel: about a second off a job's first python call, tens of MB
    per ready sandbox); only for jobs that open their sandbox without an environment."""


@dataclass
class LLMSection:
    backends: list[dict[str, Any]] = field(
        default_factory=lambda: [{"kind": "transformers", "model": "smollm2"}])
    """Each: ``{kind = "transformers", model = "smollm2" | DIR, device = "cpu"}``,
    ``{kind = "vllm", url = "http://host:port", model = NAME, tokenizer = DIR}``,
    ``{kind = "vllm-launch", model = DIR, port = 8001}``, or the testing-only
    ``{kind = "scripted", file = "script.jsonl", tokenizer = DIR}``. An empty list runs
    without a model (environments that need none)."""
    health_interval_s: float = 5.0


@dataclass
class ClusterSection:
    ray: str = ""
    """Run stage work on a Ray cluster: its address (``host:port``) or ``auto``. One node agent
    (a Ray actor) starts on every node that offers the custom resource ``rollout_node``; the
    gRPC front, scheduler and job store stay in the server process. Empty = in-process."""
    workers: int = 0
    """Run stage work in this many local processes (node agents on a private local Ray
    instance) instead of the server process; 0 = in-process. Not with ``ray``."""
    slots_per_node: int = 8
    """Jobs (sandboxes) one node agent holds at once, unless its node offers the custom
    resource ``rollout_slots`` (then that many)."""
    handlers: dict[str, str] = field(default_factory=dict)
    """Extra environments for the nodes, ``name = "module:attribute"`` (importable there)."""
    node_state_dir: str = ""
    """Node-local directory for sandbox workspaces; empty = ``$TMPDIR/rollout-nodes``."""
    poll_s: float = 1.0
    """How often the server looks for nodes that joined or left."""


@dataclass
class Config:
    server: ServerSection = field(default_factory=ServerSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    store: StoreSection = field(default_factory=StoreSection)
    sandbox: SandboxSection = field(default_factory=SandboxSection)
    llm: LLMSection = field(default_factory=LLMSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)

    @property
    def state_path(self) -> Path:
        return Path(self.server.state_dir).expanduser().resolve()

    @property
    def address(self) -> str:
        return f"{self.server.host}:{self.server.port}"


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: Sequence[str] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """Build the configuration. ``overrides`` are ``dotted.key=value`` strings (flags)."""
    cfg = Config()
    environ = os.environ if environ is None else environ
    path = path or environ.get(ENV_PREFIX + "CONFIG") or None
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"cannot read config file {path}: {exc}",
                                  "BAD_CONFIG") from exc
        for section, values in data.items():
            if section == "client":  # the `rollout` command line's own table (entrypoints/cli.py)
                continue
            if not isinstance(values, dict):
                raise InvalidArgument(f"config: [{section}] must be a table", "BAD_CONFIG")
            for key, value in values.items():
                _set(cfg, f"{section}.{key}", value)
    for name, raw in environ.items():
        if name.startswith(ENV_PREFIX) and "__" in name:
            section, key = name[len(ENV_PREFIX):].lower().split("__", 1)
            _set(cfg, f"{section}.{key}", _parse(raw))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise InvalidArgument(f"--set wants key=value, got {item!r}", "BAD_CONFIG")
        _set(cfg, key.strip(), _parse(raw))
    _check(cfg)
    return cfg


def _check(cfg: Config) -> None:
    """Values that are well-typed but not allowed (the generic setter only checks types)."""
    mode = cfg.store.synchronous.strip().upper()
    if mode not in SYNCHRONOUS_MODES:
        raise InvalidArgument(
            f"config key 'store.synchronous': {cfg.store.synchronous!r} is not allowed; use "
            "FULL (the default: a commit survives a power cut) or NORMAL (faster commits; a "
            "power cut can lose the last transactions)", "BAD_CONFIG", "store.synchronous")
    cfg.store.synchronous = mode
    if cfg.sandbox.host_view not in HOST_VIEWS:
        raise InvalidArgument(
            f"config key 'sandbox.host_view': {cfg.sandbox.host_view!r} is not allowed; use "
            "minimal (the default: a sandbox sees only what its job needs) or host (the whole "
            "host root read-only, for trusted workloads)", "BAD_CONFIG", "sandbox.host_view")
    for key in ("max_address_space_bytes", "max_processes", "max_open_files"):
        if getattr(cfg.sandbox, key) < 1:
            raise InvalidArgument(f"config key 'sandbox.{key}' must be a positive integer",
                                  "BAD_CONFIG", f"sandbox.{key}")
    if cfg.sandbox.image_build_network not in ("host", "allowlist"):
        raise InvalidArgument(f"config key 'sandbox.image_build_network': "
                              f"{cfg.sandbox.image_build_network!r} is not one of host, "
                              "allowlist", "BAD_CONFIG", "sandbox.image_build_network")
    from rollout.runtime.sandbox.images.egress import check_entries

    for key in ("image_build_hosts", "verifier_hosts"):
        try:
            check_entries(getattr(cfg.sandbox, key))
        except ValueError as e:
            raise InvalidArgument(f"config key 'sandbox.{key}': {e}", "BAD_CONFIG",
                                  f"sandbox.{key}") from None
    if cfg.sandbox.image_rootless_root not in ("auto", "overlay", "copy"):
        raise InvalidArgument(f"config key 'sandbox.image_rootless_root': "
                              f"{cfg.sandbox.image_rootless_root!r} is not one of auto, overlay, "
                              "copy", "BAD_CONFIG", "sandbox.image_rootless_root")
    if cfg.sandbox.image_setuid not in ("strip", "refuse"):
        raise InvalidArgument(f"config key 'sandbox.image_setuid': {cfg.sandbox.image_setuid!r} "
                              "is not allowed; use strip or refuse", "BAD_CONFIG",
                              "sandbox.image_setuid")
    for path in cfg.sandbox.visible_paths:
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidArgument(f"config key 'sandbox.visible_paths': {path!r} is not an "
                                  "absolute path", "BAD_CONFIG", "sandbox.visible_paths")
    for tool in cfg.sandbox.pool_tools:
        if tool not in ("bash", "python"):
            raise InvalidArgument(f"config key 'sandbox.pool_tools': {tool!r} is not a tool "
                                  "the pool can start; use bash and/or python", "BAD_CONFIG",
                                  "sandbox.pool_tools")
    for key in ("pool_size", "pool_memory_bytes", "pool_idle_s"):
        if getattr(cfg.sandbox, key) < 0:
            raise InvalidArgument(f"config key 'sandbox.{key}': {getattr(cfg.sandbox, key)!r} "
                                  "is negative; use 0 or more", "BAD_CONFIG", f"sandbox.{key}")


def _parse(raw: str) -> Any:
    """Flag and environment values: JSON when it parses (numbers, lists, tables), else text."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _set(cfg: Config, dotted: str, value: Any) -> None:
    section_name, _, key = dotted.partition(".")
    section = getattr(cfg, section_name, None)
    if section is None or not dataclasses.is_dataclass(section) or not key:
        raise InvalidArgument(f"unknown config key {dotted!r}; sections are server, pipeline, "
                              "store, sandbox, llm, cluster", "BAD_CONFIG")
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        raise InvalidArgument(
            f"unknown config key {dotted!r}; [{section_name}] has: {', '.join(fields)}",
            "BAD_CONFIG")
    current = getattr(section, key)
    try:
        if isinstance(current, bool):
            value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
        elif isinstance(current, int):
            value = int(value)
        elif isinstance(current, float):
            value = float(value)
        elif isinstance(current, str):
            value = str(value)
        elif isinstance(current, list) and not isinstance(value, list):
            raise TypeError("expected a list")
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"config key {dotted!r}: bad value {value!r} ({exc})",
                              "BAD_CONFIG") from exc
    setattr(section, key, value)
