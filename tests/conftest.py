"""Suite-wide settings. Package-specific fixtures live in each folder's conftest.py."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
# the image, harbor and SWE-image tests.
pytest_plugins = ["tests.fixtures.images"]


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
