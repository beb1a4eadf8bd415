"""The TLS / mTLS example of docs/operating.md, run as written: its openssl commands make the
PKI, its TOML block configures a real server, and its Python block connects as the mapped
client."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rollout.runtime.handler import HandlerRegistry
from rollout.server.app import Server
from rollout.server.config import load_config
from tests.client.conftest import _no_sandbox
from tests.docs import block
from tests.server.handlers import ScriptedHandler

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)


def _block(tag: str) -> str:
    return block(tag)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
async def test_readme_tls_example_runs(tmp_path: Path) -> None:
    made = subprocess.run(["bash", "-euo", "pipefail", "-c", _block("bash tls-certs")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    config = tmp_path / "rollout.toml"
    config.write_text(_block("toml tls-config"))
    assert tomllib.loads(config.read_text())["server"]["clients"][0]["client_id"] == "trainer-a"
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the guide's paths are relative to where `rollout serve` runs
    try:
        cfg = load_config(config, ["server.port=0", f"server.state_dir={tmp_path / 'state'}",
                                   "llm.backends=[]"], environ={})
        registry = HandlerRegistry()
        registry.register("scripted", ScriptedHandler())
        server = await Server(cfg, registry=registry, sandbox_factory=_no_sandbox).start()
    finally:
        os.chdir(cwd)
    try:
        script = _block("python tls-client").replace("localhost:50051",
                                                     f"localhost:{server.port}")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert out.decode().strip() == "0 jobs of trainer-a"
        # Without the client certificate the same script cannot get in.
        no_cert = script.replace('private_key=open("pki/trainer-a.key", "rb").read(),', "")
        no_cert = no_cert.replace('certificate_chain=open("pki/trainer-a.crt", "rb").read()',
                                  "")
        assert no_cert != script
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", no_cert, cwd=tmp_path, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode != 0 and b"UNAVAILABLE" in err
    finally:
        await server.stop(0.1)
