"""Start-up waits survive a busy machine.

The README's test command once failed at load ~6: IPython kernels "did not start within
30 s". The cause was not the 30 s: jupyter_client's ``wait_for_ready`` declared a kernel dead
after one missed 1 s heartbeat, i.e. whenever importing IPython took longer than about a
second. These tests pin down the fix (readiness is a ``kernel_info`` answer; death is the
process exiting), the one knob for genuinely slow machines (``ROLLOUT_TIMEOUT_SCALE``), and
run the tool and sandbox tests beside two busy-loop processes.
"""

from __future__ import annotations

import getpass
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout.runtime.timeouts import ENV_VAR, scaled, timeout_scale
from rollout.runtime.tools.ipython import KERNEL_STARTUP_S, IPythonKernel, KernelError
from tests.util import assert_eventually, hang_guard_factor, patience

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def test_timeout_scale_reads_the_environment() -> None:
    assert timeout_scale({}) == 1.0
    assert timeout_scale({ENV_VAR: " 2.5 "}) == 2.5
    assert scaled(30, {ENV_VAR: "4"}) == 120
    for bad in ("abc", "0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=ENV_VAR):
            timeout_scale({ENV_VAR: bad})


def _slow_python(tmp_path: Path, delay_s: float) -> str:
    """An interpreter that takes ``delay_s`` to come up, as IPython does on a loaded machine."""
    script = tmp_path / "slow-python"
    script.write_text(f"#!/bin/sh\nsleep {delay_s}\nexec {sys.executable} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


async def test_a_kernel_slower_than_a_heartbeat_still_starts(tmp_path: Path) -> None:
    """3 s before the kernel even binds its sockets: three missed heartbeats, which
    jupyter_client's own readiness wait reports as a dead kernel."""
    kernel = await IPythonKernel.start(None, python=_slow_python(tmp_path, 3))
    try:
        res = await kernel.execute("6 * 7")
        assert res.ok and res.output == "42\n"
    finally:
        await kernel.close()


async def test_kernel_start_deadline_follows_the_scale(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "0.01")
    with pytest.raises(KernelError, match=rf"did not answer within {KERNEL_STARTUP_S * 0.01:g} s"):
        await IPythonKernel.start(None, python=_slow_python(tmp_path, 5))


async def test_a_kernel_that_exits_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(KernelError, match=r"exited \(status 3\) before answering"):
        await IPythonKernel.start(None, python=_exiting_python(tmp_path))


async def test_kernels_that_exit_at_once_leave_no_thread_behind_or_dying(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's channel threads must not race the close: a heartbeat thread, started
    beside a kernel that was already dying, once died of a ZeroMQ error printed to the
    server's log (about one start in six)."""
    died: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    dead = _exiting_python(tmp_path)
    before: set[threading.Thread] = set()
    for k in range(20):
        with pytest.raises(KernelError, match="exited"):
            await IPythonKernel.start(None, python=dead)
        if k == 0:  # the process-wide spawner and the loop's executor exist from now on
            before = set(threading.enumerate())
    assert not died, [f"{a.thread}: {a.exc_value!r}" for a in died]

    def only_lasting_threads() -> bool:
        extra = set(threading.enumerate()) - before
        assert all(t.name.startswith(("reap-kernel-", "asyncio_")) for t in extra), extra
        return True
    await assert_eventually(only_lasting_threads)


def _exiting_python(tmp_path: Path) -> str:
    script = tmp_path / "dead-python"
    script.write_text("#!/bin/sh\necho 'no kernel here' >&2\nexit 3\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


async def test_assert_eventually_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "0.01")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    with pytest.raises(AssertionError, match=r"within 0\.1 s"):
        await assert_eventually(lambda: False, timeout=10)
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 8.0, 8.0))  # 4 per core on 2 cores
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(AssertionError, match=r"within 0\.4 s"):
        await assert_eventually(lambda: False, timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tool_and_sandbox_tests_pass_beside_a_cpu_hog(tmp_path: Path) -> None:
    """Two busy loops (this machine has two cores) for the whole run of the IPython, bash and
    sandbox tests, at the default scale unless the caller set one."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        # pytest-timeout's thread method: a test that hangs, even in its teardown, ends the
        # child with every thread's stack printed, which this test then shows. Unbuffered, so
        # what the child printed before a hang is all here.
        code, out = _run_child(
            _pytest_argv(tmp_path, "-v", "-x", "-o", "timeout_method=thread",
                         "tests/runtime/test_tools_ipython.py", "tests/runtime/test_tools_bash.py",
                         "tests/runtime/test_sandbox.py"), timeout=scaled(840))
    finally:
        alive = all(h.poll() is None for h in hogs)
        for h in hogs:
            h.kill()
            h.wait()
    assert code is not None, f"the child suite did not finish in {scaled(840):g} s:\n{out}"
    assert alive, "the load lasted the whole run"
    assert code == 0, out
    assert " passed" in out and "failed" not in out, out
    assert "most recent call first" not in out, out  # no stack dump (the exit watchdog's)


def _pytest_argv(tmp_path: Path, *args: str) -> list[str]:
    """A child pytest with its own base folder for ``tmp_path``. Without one, a session ends
    by deleting the numbered folders of earlier sessions of the same user (pytest keeps the
    last three): on a machine that keeps ``/tmp`` between CI runs, that is a whole earlier
    suite's gigabytes of images and sandboxes, deleted after the child's last test and
    before it exits."""
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
            f"--basetemp={tmp_path / 'child-basetemp'}", *args]


def _run_child(argv: list[str], timeout: float, scale: str | None = None,
               done_when: str | None = None) -> tuple[int | None, str]:
    """Run a child pytest; its exit status (``None`` if it overran ``timeout``) and the tail of
    its output. One that overruns is asked for its threads' stacks (``tests/conftest.py``
    registers SIGUSR1 for that) before it is killed, so a hang says where it is.
    ``done_when``: output that ends the child's work; from the moment it appears the child has
    only a few seconds more to exit (a child that hangs in its exit is given up on then, not
    after the whole ``timeout``)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    if scale is not None:
        env[ENV_VAR] = scale
    chunks: list[bytes] = []
    seen = threading.Event()
    with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=env) as child:
        assert child.stdout is not None
        out = child.stdout

        def read() -> None:
            while chunk := out.read1(65536):
                chunks.append(chunk)
                if done_when is not None and done_when.encode() in b"".join(chunks[-2:]):
                    seen.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        code: int | None = None
        while (code := child.poll()) is None and time.monotonic() < deadline:
            if seen.wait(0.1):
                deadline = min(deadline, time.monotonic() + patience(3))
                seen.clear()
        if code is None:
            child.send_signal(signal.SIGUSR1)
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                pass
            child.kill()
            child.wait()
        reader.join(10)
    return code, b"".join(chunks).decode(errors="replace")[-12000:]


def test_hang_guards_grow_with_the_load() -> None:
    assert hang_guard_factor(0.3, 2) == 1.0
    assert hang_guard_factor(14.0, 2) == 6.0
    assert hang_guard_factor(6.0, 2) == 3.0
    assert hang_guard_factor(1.0, 2, scale=4.0) == 4.0


def test_the_scaled_guard_is_the_one_applied(tmp_path: Path) -> None:
    probe = tmp_path / "guard"
    env = {**os.environ, ENV_VAR: "50", "ROLLOUT_GUARD_PROBE": str(probe)}
    subprocess.run(_pytest_argv(tmp_path, "-q", "tests/guard_probe.py"),
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=100)
    assert 7 * 50 <= float(probe.read_text()) <= 7 * 50 * 6


def test_a_blocked_worker_thread_fails_its_test_instead_of_hanging_the_suite(
        tmp_path: Path) -> None:
    """Without the bounded executor shutdown in ``tests/conftest.py``, this child never exits."""
    env = {**os.environ, ENV_VAR: "0.1"}
    res = subprocess.run(_pytest_argv(tmp_path, "-q", "tests/stuck_worker_probe.py"),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(90))
    assert res.returncode == 1, res.stdout[-3000:]
    assert "StuckWorkerThread" in res.stdout and "in wait" in res.stdout  # its stack
    assert "worker threads still blocked at exit" in res.stderr


def test_a_process_that_cannot_exit_reports_its_stacks_and_fails(tmp_path: Path) -> None:
    """A thread nobody stops blocks the interpreter's exit after every test passed: the exit
    watchdog in ``tests/conftest.py`` prints the stacks and fails the run instead of hanging."""
    env = {**os.environ, ENV_VAR: "0.1"}
    res = subprocess.run(_pytest_argv(tmp_path, "-q", "tests/exit_hang_probe.py"),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(90))
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1 passed" in res.stdout
    assert "Timeout (" in res.stderr and "in block_forever" in res.stderr  # the stuck stack


def test_a_stuck_child_is_asked_for_its_stacks_before_it_is_killed(tmp_path: Path) -> None:
    """The exit watchdog is pushed past the deadline here: the parent's SIGUSR1 is what
    brings the stacks out."""
    code, out = _run_child(_pytest_argv(tmp_path, "-q", "tests/exit_hang_probe.py"),
                           timeout=patience(60), scale="100", done_when=" passed")
    assert code is None, out
    assert "1 passed" in out and "in block_forever" in out and "Timeout (" not in out, out


def test_a_worker_done_early_waits_for_the_others(tmp_path: Path) -> None:
    """Under xdist a worker with no more files ends its session and then waits, legitimately,
    until the master ends it after the last worker's last test: that wait is no hang at exit.
    The exit watchdog used to be armed there, so at load 20 a worker done four minutes early
    was killed ("node down: Not properly terminated"), the run got a failure no test made,
    and xdist's master then waited for good."""
    code, out = _run_child(_pytest_argv(tmp_path, "-q", "-n", "2", "--dist", "loadfile",
                                        "tests/early_worker_probe_quick.py",
                                        "tests/early_worker_probe_slow.py"),
                           timeout=patience(90), scale="0.05")
    assert code == 0, out
    assert "2 passed" in out and "Timeout (" not in out and "node down" not in out, out


def test_a_child_suite_leaves_other_sessions_folders_alone(tmp_path: Path) -> None:
    """The child suites above end without deleting earlier sessions' folders (see
    ``_pytest_argv``): with pytest's default, this child would delete ``pytest-0`` and
    ``pytest-1`` below, as the cpu-hog child once deleted an earlier CI run's."""
    user_root = tmp_path / "tmp" / f"pytest-of-{getpass.getuser()}"
    for n in range(6):  # finished sessions: no lock file
        (user_root / f"pytest-{n}").mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    res = subprocess.run(_pytest_argv(tmp_path, "-q", "tests/guard_probe.py"), cwd=ROOT,
                         env={**env, "ROLLOUT_GUARD_PROBE": str(tmp_path / "guard")},
                         capture_output=True, text=True, timeout=scaled(90))
    assert res.returncode == 0, res.stdout[-3000:]
    assert sorted(p.name for p in user_root.iterdir()) == [f"pytest-{n}" for n in range(6)]
