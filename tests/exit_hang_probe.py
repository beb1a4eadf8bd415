"""Run only by ``tests/test_under_load.py``: a test that passes and leaves a non-daemon thread
blocked for ever, which the interpreter's exit then waits for."""

import threading

never = threading.Event()


def block_forever() -> None:
    never.wait()


def test_leaves_a_thread_that_never_ends() -> None:
    threading.Thread(target=block_forever, name="never-ends").start()
