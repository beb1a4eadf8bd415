"""Suite-wide settings. Package-specific fixtures live in each folder's conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pytest

from tests.util import patience

# Keep the model cache of the test suite in one place across runs (CI and developers), and
# make sure nothing ever tries to reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _raise_open_file_limit() -> None:
    """The suite's one process opens many real servers, sandboxes and kernels in turn, and a
    few descriptors outlive their test until the garbage collector runs. A soft limit of 1024
    (a common default) was reached once on a busy machine: use the hard limit, as servers do."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


_raise_open_file_limit()
# The image fixtures (a loopback registry, the cached base image, a busybox image) are shared by
# the image, harbor and SWE-image tests; the hosts' (HTTP servers an allow-list may name) by the
# build network's and the verifier network's.
pytest_plugins = ["tests.fixtures.images", "tests.fixtures.hosts"]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stretch the test's pytest-timeout guard (a hang guard sized for an idle machine, not a
    speed check) by ``tests.util.patience`` as the test starts, before pytest-timeout's own
    wrapper reads the marker: a guard that grows with the contention still catches a hang."""
    marker = item.get_closest_marker("timeout")
    kwargs = dict(marker.kwargs) if marker is not None else {}
    base = kwargs.pop("timeout", None)
    if marker is not None and marker.args:
        base = marker.args[0]
    if base is None:
        base = getattr(item.config, "_env_timeout", None)  # the ini / command-line default
    if base:
        item.add_marker(pytest.mark.timeout(patience(float(base)), **kwargs), append=False)
    yield


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh folder directly below /tmp, for tests that bind Unix sockets at a path they
    choose: ``sun_path`` holds 107 bytes, and ``tmp_path`` can be longer (a parallel worker's
    adds ``popen-gwN/``)."""
    d = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


_STACKS_TO: list[TextIO] = []


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """A parent that gives up waiting for this process (``tests/test_under_load.py`` runs the
    suite's tool tests in a child) sends SIGUSR1 first: every thread's stack then goes to
    stderr, whatever the process is stuck in, its exit included. A copy of the real stderr
    made here, where pytest's capture of it is suspended, and kept for the process's life."""
    if not _STACKS_TO:
        _STACKS_TO.append(os.fdopen(os.dup(2), "w"))
        faulthandler.register(signal.SIGUSR1, file=_STACKS_TO[0], all_threads=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding a ``slow`` test run first. The runner gives each of its two workers whole
    files from the front of this order (``scripts/test.sh`` turns off xdist's own order, which
    puts the files with the most tests first, so a file of one or two long tests could start
    last, one worker idle beside it); short files fill in at the end, so both finish together.
    Items of one file stay together and in their order (their module fixtures start once)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files keep their order


# How long a test's event loop waits, once the test is over, for the worker threads its
# ``asyncio.to_thread`` calls started (stretched by ``patience``).
WORKER_GRACE_S = 30.0


class StuckWorkerThread(Exception):
    """A ``to_thread`` call of a finished test is still blocked: a wait without a deadline."""


def _worker_stacks() -> str:
    """The stacks of the busy threads of every event loop's default executor (``asyncio_N``);
    an idle one waits on its queue in ``concurrent.futures``' ``_worker`` itself."""
    frames = sys._current_frames()
    return "\n".join(
        f"thread {t.name}:\n" + "".join(traceback.format_stack(frame))
        for t in threading.enumerate()
        if t.name.startswith("asyncio_") and (frame := frames.get(t.ident or 0)) is not None
        and frame.f_code.co_name != "_worker")


class _BoundedCloseLoop(asyncio.SelectorEventLoop):
    """Python 3.11's ``shutdown_default_executor`` joins the executor's threads with no
    deadline, so one ``asyncio.to_thread(proc.stdout.readline)`` whose child never answers
    hangs the test's teardown for ever, after pytest-timeout's one-shot guard has fired:
    a whole CI run was lost to that once. Here the wait is bounded, and running past it
    fails the test with the stuck threads' stacks."""

    async def shutdown_default_executor(self) -> None:
        self._executor_shutdown_called = True  # type: ignore[attr-defined]
        executor = self._default_executor  # type: ignore[attr-defined]
        if executor is None:
            return
        done = self.create_future()

        def finish() -> None:
            if not done.done():
                done.set_result(None)

        def shut_down() -> None:
            executor.shutdown(wait=True)
            with contextlib.suppress(RuntimeError):  # the loop closed while we waited
                self.call_soon_threadsafe(finish)

        threading.Thread(target=shut_down, name="executor-shutdown", daemon=True).start()
        grace = patience(WORKER_GRACE_S)
        try:
            await asyncio.wait_for(asyncio.shield(done), grace)
        except TimeoutError:
            raise StuckWorkerThread(
                f"a to_thread call was still blocked {grace:g} s after its test ended:\n"
                + _worker_stacks()) from None


def pytest_asyncio_loop_factories(config: pytest.Config,
                                  item: pytest.Item) -> dict[str, type[_BoundedCloseLoop]]:
    """pytest-asyncio's hook for the loops of async tests and fixtures."""
    return {"loop": _BoundedCloseLoop}


_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


EXIT_GRACE_S = 60.0
"""How long the interpreter's exit (joining threads, ``atexit`` handlers) may take once pytest
is done, stretched by ``patience``."""


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A worker thread still blocked now would hang the interpreter's exit (it joins them):
    report it and leave with the suite's status instead.

    Anything else that blocks the exit (a non-daemon thread, an ``atexit`` handler, a
    finaliser) is caught by a watchdog: past ``EXIT_GRACE_S`` it prints every thread's stack
    and ends the process with a failing status, so a hang at exit is a reported failure, never
    a lost CI run.

    Not in an xdist worker: one whose files are done ends its session here and then waits,
    for as long as the other worker's files take, until the master ends it; the master kills
    a worker that does not exit within 10 s of that, and the master's own exit is guarded."""
    sys.stdout.flush()
    sys.stderr.flush()
    stuck = _worker_stacks()
    if stuck:
        sys.stderr.write(f"worker threads still blocked at exit:\n{stuck}\n")
        sys.stderr.flush()
        os._exit(_exit_status[-1] if _exit_status and _exit_status[-1] else 1)
    if hasattr(config, "workerinput"):
        return
    # faulthandler's own C timer, not a Python thread: it needs no interpreter lock, so it
    # also fires in the last phase of the exit, where Python threads no longer run. It prints
    # "Timeout (h:mm:ss)!" and every thread's stack, then exits with status 1.
    faulthandler.dump_traceback_later(patience(EXIT_GRACE_S), exit=True,
                                      file=_STACKS_TO[0] if _STACKS_TO else sys.stderr)
