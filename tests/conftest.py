"""Suite-wide settings. Package-specific fixtures live in each folder's conftest.py."""

from __future__ import annotations

import os

# Keep the model cache of the test suite in one place across runs (CI and developers), and
# make sure nothing ever tries to reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The image fixtures (a loopback registry, the cached base image, a busybox image) are shared by
# the image, harbor and SWE-image tests.
pytest_plugins = ["tests.fixtures.images"]
