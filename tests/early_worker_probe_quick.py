"""Run only by ``tests/test_under_load.py`` (with ``early_worker_probe_slow.py``, one file per
xdist worker): the worker that gets this file is done long before the other, and waits for
xdist's master to end it."""


def test_done_at_once() -> None:
    pass
