"""The build network's allow-list for real: buildah in a network namespace of its own whose only
exits are the allow-listing proxy and the forwarded loopback registry. FROM still comes from the
loopback mirror; a RUN step reaches an allowed host through the proxy, is refused another one
with a 403 naming it, and cannot reach anything by its own sockets. The same probe on the
host's network (the default) reaches everything: what the allow-list takes away."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.sandbox.base import ImageSettings, SandboxUnavailable
from rollout.runtime.sandbox.images import (
    BuildSpec,
    ImageError,
    build,
    build_image,
    cache_for,
    subids,
)
from rollout.runtime.sandbox.images.egress import AllowList, check_entries, registry_endpoints
from tests.fixtures.images import Registry, skip_unless_images
from tests.runtime.images import test_rootless_images as rootless

BUILD_CHILD = Path(__file__).with_name("subids_build_child.py")
subids_user = rootless.subids_user
"""The session's user with subordinate ids (a fixture of the rootless tests)."""

pytestmark = pytest.mark.timeout(600)

PROBE = """\
import json, os, socket, sys, urllib.request
host, allowed, other = sys.argv[1], sys.argv[2], sys.argv[3]
seen = {}
def fetch(port):
    try:
        return urllib.request.urlopen(f"http://{host}:{port}/f", timeout=10).read().decode()
    except Exception as e:
        return f"{type(e).__name__}: {getattr(e, 'code', '')} {e}"
seen["allowed"] = fetch(allowed)
seen["other"] = fetch(other)
try:  # a step that ignores the proxy
    socket.create_connection((host, int(allowed)), timeout=5).close()
    seen["direct"] = "connected"
except OSError as e:
    seen["direct"] = f"{type(e).__name__}: {e}"
open("/probe.json", "w").write(json.dumps(seen))
print("PROBE", json.dumps(seen), flush=True)
"""

NEEDS_OTHER = """\
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10)
except Exception as e:
    sys.exit(f"fetching {sys.argv[1]} failed: {e}")
"""
"""A step that needs a host off the list (its error is one line, so the log's tail keeps the
probe's line above it)."""


def _context(root: Path, addr: str, allowed: int, other: int, extra: str = "") -> Path:
    root.mkdir(parents=True)
    (root / "probe.py").write_text(PROBE)
    (root / "needs_other.py").write_text(NEEDS_OTHER)
    (root / "Dockerfile").write_text(
        "FROM python:3.11-slim\nCOPY probe.py needs_other.py /\n"
        f"RUN python3 /probe.py {addr} {allowed} {other}\n{extra}")
    return root


@pytest.mark.slow
def test_a_build_reaches_only_the_registries_and_the_allowed_hosts(
        image_registry: Registry, tmp_path: Path, mirrors: tuple[str, int, int]) -> None:
    skip_unless_images("buildah")
    if os.geteuid() != 0:
        pytest.skip("the build network's allow-list needs a root server")
    addr, allowed, other = mirrors
    confined = dataclasses.replace(image_registry.settings(tmp_path / "confined"),
                                   build_network="allowlist",
                                   build_hosts=(f"{addr}:{allowed}",))
    image = build_image(cache_for(confined), BuildSpec(
        _context(tmp_path / "a", addr, allowed, other), label="confined", timeout_s=400))
    seen = json.loads((image.rootfs / "probe.json").read_text())
    assert seen["allowed"] == f"served by {allowed}", seen
    assert "403" in seen["other"], seen
    assert seen["direct"].startswith("OSError") and "unreachable" in seen["direct"], seen
    # A step that needs a host off the list fails the build, the message naming the host.
    with pytest.raises(ImageError) as err:
        build_image(cache_for(confined), BuildSpec(
            _context(tmp_path / "b", addr, allowed, other,
                     f"RUN python3 /needs_other.py http://{addr}:{other}/f\n"),
            label="needs-other", timeout_s=400))
    assert err.value.reason == "IMAGE_BUILD_FAILED"
    assert f"the build network refused {addr}:{other}" in str(err.value), str(err.value)
    assert "sandbox.image_build_hosts" in str(err.value)
    # The host's network (the default) reaches both, directly too.
    free = image_registry.settings(tmp_path / "free")
    image = build_image(cache_for(free), BuildSpec(
        _context(tmp_path / "c", addr, allowed, other), label="free", timeout_s=400))
    seen = json.loads((image.rootfs / "probe.json").read_text())
    assert seen == {"allowed": f"served by {allowed}", "other": f"served by {other}",
                    "direct": "connected"}, seen


def test_allow_list_entries_and_the_registries_conf(tmp_path: Path) -> None:
    allow = AllowList(("deb.debian.org", "pypi.org:443", "*.pythonhosted.org"))
    assert allow.allows("deb.debian.org", 80) and allow.allows("DEB.debian.org.", 443)
    assert not allow.allows("deb.debian.org", 22) and not allow.allows("pypi.org", 80)
    assert allow.allows("files.pythonhosted.org", 443)
    assert not allow.allows("pythonhosted.org", 443) and not allow.allows("evil.org", 443)
    assert check_entries([" pypi.org:443 "]) == ("pypi.org:443",)
    for bad in ("http://x", "a b", "", "user@host", "*."):
        with pytest.raises(ValueError):
            check_entries([bad])
    conf = tmp_path / "registries.conf"
    conf.write_text('[[registry]]\nprefix = "docker.io"\nlocation = "docker.io"\n'
                    '[[registry.mirror]]\nlocation = "127.0.0.1:5000"\n'
                    '[[registry.mirror]]\nlocation = "mirror.corp:5443/hub"\n')
    assert registry_endpoints(str(conf)) == (("docker.io", "mirror.corp:5443"), (5000,))


@pytest.mark.slow
def test_a_rootless_server_confines_its_builds_the_same_way(
        image_registry: Registry, mirrors: tuple[str, int, int],
        subids_user: rootless.SubIdsUser) -> None:
    # A server that is not root cannot enter a network namespace: the listeners are made
    # inside a user namespace of its own (its subordinate ranges mapped, as rootless buildah
    # maps its own) and handed out; buildah runs there with them as its only exits. One build:
    # its probe step prints what it reached, then a step needs a host off the list.
    skip_unless_images("buildah")
    addr, allowed, other = mirrors
    uid, gid = subids_user.uid, subids_user.gid
    top = Path(tempfile.mkdtemp(prefix="rootless-build-", dir="/tmp"))
    try:
        _context(top / "b", addr, allowed, other,
                 f"RUN python3 /needs_other.py http://{addr}:{other}/f\n")
        conf = top / "registries.conf"
        shutil.copyfile(image_registry.registries_conf, conf)
        for d, _, files in os.walk(top):
            for name in (d, *(os.path.join(d, f) for f in files)):
                os.lchown(name, uid, gid)
        os.chmod(top, 0o755)
        seen = rootless._run_as(uid, gid, BUILD_CHILD, top, args=(str(conf), f"{addr}:{allowed}"),
                       timeout=900)
        assert seen["euid"] == uid, seen
        reason, message = seen["refused"]  # type: ignore[misc]
        assert reason == "IMAGE_BUILD_FAILED", seen["refused"]
        assert f"the build network refused {addr}:{other}" in message, message
        probe_line = re.search(r"^PROBE (\{.*\})$", message, re.M)
        assert probe_line, message
        probe = json.loads(probe_line.group(1))
        assert probe["allowed"] == f"served by {allowed}", probe
        assert "403" in probe["other"], probe
        assert probe["direct"].startswith("OSError"), probe
        assert f"fetching http://{addr}:{other}/f failed: HTTP Error 403" in message, message
        assert seen["left"] == [], seen["left"]
    finally:
        subprocess.run(["rm", "-rf", str(top)], check=False, timeout=300)


def test_a_rootless_server_without_subordinate_ids_says_what_to_add(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.os, "geteuid", lambda: 4321)
    monkeypatch.setattr(subids, "lookup", lambda uid: (None, f"user {uid} has no range in "
                                                             "/etc/subuid"))
    cache = cache_for(ImageSettings(cache_dir=str(tmp_path), build_network="allowlist",
                                    build_hosts=("pypi.org",)))
    with pytest.raises(SandboxUnavailable) as err:
        build._egress(cache)
    assert "user 4321 has no range in /etc/subuid" in str(err.value)
    assert 'set it to "host"' in str(err.value)


async def test_an_allowed_name_that_resolves_to_this_machine_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An allowed name is not a way to the server's own services: one that resolves to a
    # loopback address is refused unless the entry names the loopback itself. The proxy
    # connects to the address it resolved (no second lookup a rebinding name could change).
    import asyncio
    import http.server
    import socket
    import threading

    from rollout.runtime.sandbox.images.egress import AllowListProxy

    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args: object) -> None:
            pass

    own = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=own.serve_forever, daemon=True).start()
    port = own.server_address[1]
    real = socket.getaddrinfo

    def lookup(host: Any, *args: Any, **kw: Any) -> Any:
        return real("127.0.0.1" if host == "sneaky.test" else host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    proxy = AllowListProxy(AllowList((f"sneaky.test:{port}", f"127.0.0.1:{port}")),
                           "test network", "only the test's hosts")
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    proxy_port = server.sockets[0].getsockname()[1]

    async def get(host: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
        writer.write(f"GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}\r\n"
                     "Connection: close\r\n\r\n".encode())
        answer = await reader.read()
        writer.close()
        return answer

    try:
        refused, served = await get("sneaky.test"), await get("127.0.0.1")
    finally:
        server.close()
        own.shutdown()
        own.server_close()
    assert refused.startswith(b"HTTP/1.1 403") and b"sneaky.test" in refused, refused
    assert served.startswith(b"HTTP/1.0 200") and served.endswith(b"hello"), served
    assert proxy.refused == [f"sneaky.test:{port}"]
