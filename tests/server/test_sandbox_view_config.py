"""The sandbox view as a server setting: ``sandbox.host_view`` and ``sandbox.visible_paths``
reach the sandboxes a server starts, and a bad value stops start-up with BAD_CONFIG."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.runtime.types import InvalidArgument
from rollout.server.app import build_sandbox_factory
from rollout.server.config import load_config


def test_the_default_is_the_minimal_view(tmp_path: Path) -> None:
    cfg = load_config(None, [f"server.state_dir={tmp_path}"], environ={})
    assert build_sandbox_factory(cfg).args[0].host_view == "minimal"


def test_host_view_and_visible_paths_reach_the_sandbox_config(tmp_path: Path) -> None:
    cfg = load_config(None, [f"server.state_dir={tmp_path}", "sandbox.host_view=host",
                             'sandbox.visible_paths=["/opt/toolchain"]'], environ={})
    sandbox = build_sandbox_factory(cfg).args[0]
    assert sandbox.host_view == "host" and sandbox.visible_paths == ("/opt/toolchain",)
    cfg = load_config(None, [f"server.state_dir={tmp_path}"],
                      environ={"ROLLOUT_SANDBOX__VISIBLE_PATHS": '["/data/models"]'})
    assert build_sandbox_factory(cfg).args[0].visible_paths == ("/data/models",)


def test_the_rootless_image_root_reaches_the_image_settings(tmp_path: Path) -> None:
    cfg = load_config(None, [f"server.state_dir={tmp_path}"],
                      environ={"ROLLOUT_SANDBOX__IMAGE_ROOTLESS_ROOT": "copy"})
    assert build_sandbox_factory(cfg).args[0].images.rootless_root == "copy"
    cfg = load_config(None, [f"server.state_dir={tmp_path}",
                             "sandbox.image_build_network=allowlist",
                             'sandbox.image_build_hosts=["deb.debian.org", "pypi.org:443"]'],
                      environ={})
    images = build_sandbox_factory(cfg).args[0].images
    assert images.build_network == "allowlist"
    assert images.build_hosts == ("deb.debian.org", "pypi.org:443")
    cfg = load_config(None, [f"server.state_dir={tmp_path}",
                             'sandbox.verifier_hosts=["astral.sh", "*.pythonhosted.org"]'],
                      environ={})
    assert build_sandbox_factory(cfg).args[0].verifier_hosts == ("astral.sh",
                                                                 "*.pythonhosted.org")


@pytest.mark.parametrize(("override", "field"), [
    ("sandbox.host_view=everything", "sandbox.host_view"),
    ('sandbox.visible_paths=["relative/dir"]', "sandbox.visible_paths"),
    ("sandbox.max_processes=0", "sandbox.max_processes"),
    ("sandbox.image_rootless_root=tmpfs", "sandbox.image_rootless_root"),
    ("sandbox.image_build_network=proxy", "sandbox.image_build_network"),
    ('sandbox.image_build_hosts=["http://x"]', "sandbox.image_build_hosts"),
    ('sandbox.verifier_hosts=["pypi.org/simple"]', "sandbox.verifier_hosts")])
def test_bad_values_are_refused(override: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        load_config(None, [override], environ={})
    assert err.value.reason == "BAD_CONFIG" and err.value.field == field


def test_limit_ceilings_reach_the_sandbox_config(tmp_path: Path) -> None:
    """What a harness preset's [limits] may raise a job's sandbox to (sandbox.max_*)."""
    cfg = load_config(None, [f"server.state_dir={tmp_path}", "sandbox.max_processes=2000",
                             f"sandbox.max_address_space_bytes={8 << 30}"], environ={})
    ceilings = build_sandbox_factory(cfg).args[0].max_limits
    assert (ceilings.processes, ceilings.address_space_bytes, ceilings.open_files) == (
        2000, 8 << 30, 65536)
