"""``rollout bench images`` runs end to end on a small N and prints its comparison."""

from __future__ import annotations

import pytest
from rich.console import Console

from rollout.benchmarks import images
from tests.fixtures.images import skip_unless_images

pytestmark = pytest.mark.timeout(300)


def test_bench_images_prints_cold_warm_baseline_and_concurrent(
        capsys: pytest.CaptureFixture[str]) -> None:
    skip_unless_images()
    args = images.argparse.Namespace(iterations=3, cold=1, concurrent=3, base=False,
                                     strict=False)
    assert images.asyncio.run(images.run(args, Console(width=200))) == 0
    out = capsys.readouterr().out
    for row in ("cold: fetch + check + unpack", "concurrent first use: 3 sandboxes",
                *(f"{side} sandbox {what}" for side in ("warm: image", "baseline: plain bwrap")
                  for what in ("start (create + first command)", "destroy",
                               "start + destroy"))):
        assert row in out, out
    assert "warm image / plain start p50:" in out and "start + destroy:" in out
    assert images.server_mode() in " ".join(out.split())
    # One fetch served the concurrent first uses: one image in that cache, not three.
    assert "first use: 1 (one fetch" in " ".join(out.split())


def test_the_bench_names_the_path_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout.runtime.sandbox.images import subids

    monkeypatch.setattr(images.os, "geteuid", lambda: 0)
    assert images.server_mode() == "root server"
    monkeypatch.setattr(images.os, "geteuid", lambda: 1234)
    monkeypatch.setattr(subids, "server_subids", lambda: subids.SubIds(((100000, 65536),),
                                                                      ((100000, 65536),)))
    assert images.server_mode() == "rootless server, 65536 subordinate ids mapped"
    monkeypatch.setattr(subids, "server_subids", lambda: None)
    assert images.server_mode() == "rootless server, its own uid only"
