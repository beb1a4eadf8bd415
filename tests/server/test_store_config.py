"""``store.synchronous``: from every configuration source to the PRAGMA of a running server."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.types import InvalidArgument
from rollout.server.app import Server
from rollout.server.config import SYNCHRONOUS_MODES, load_config
from rollout.server.store import SYNCHRONOUS
from tests.docs import block

ROOT = Path(__file__).resolve().parents[2]
PRAGMA_VALUE = {"NORMAL": 1, "FULL": 2}
"""What ``PRAGMA synchronous`` reads back for each mode (SQLite's documented numbers)."""


def test_full_is_the_default_and_normal_comes_from_every_source(tmp_path: Path) -> None:
    assert load_config(None, [], environ={}).store.synchronous == "FULL"
    toml = tmp_path / "rollout.toml"
    toml.write_text('[store]\nsynchronous = "NORMAL"\n')
    assert load_config(toml, [], environ={}).store.synchronous == "NORMAL"
    env = {"ROLLOUT_STORE__SYNCHRONOUS": "normal"}  # spelled in any case
    assert load_config(None, [], environ=env).store.synchronous == "NORMAL"
    # Flags win over the environment and the file.
    assert load_config(toml, ["store.synchronous=full"], environ=env).store.synchronous == "FULL"


@pytest.mark.parametrize("value", ["OFF", "EXTRA", "", "2", "fullest"])
def test_anything_else_is_a_config_error_naming_the_key_and_the_choices(value: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        load_config(None, [f"store.synchronous={value}"], environ={})
    assert info.value.reason == "BAD_CONFIG"
    assert info.value.field == "store.synchronous"
    assert "store.synchronous" in str(info.value)
    assert "FULL" in str(info.value) and "NORMAL" in str(info.value)


def test_the_config_offers_exactly_what_the_store_accepts() -> None:
    assert set(SYNCHRONOUS_MODES) == set(SYNCHRONOUS)


def test_the_documented_configuration_block_documents_the_key() -> None:
    """The configuration block of docs/operating.md is a real configuration: it loads, and
    says FULL."""
    text = block("toml configuration")
    assert tomllib.loads(text)["store"]["synchronous"] == "FULL"
    load_config(None, [], environ={})  # the embedded defaults it documents load too


@pytest.mark.parametrize("mode", ["FULL", "NORMAL"])
async def test_a_served_store_commits_with_the_configured_mode(tmp_path: Path, mode: str) -> None:
    overrides = ["server.port=0", f"server.state_dir={tmp_path / 'state'}", "llm.backends=[]",
                 "server.grace_s=0.1", f"store.synchronous={mode.lower()}"]
    server = await Server(load_config(None, overrides, environ={}),
                          registry=HandlerRegistry()).start()
    try:
        store = server.store
        assert store is not None
        # Asked on the writer's own connection: that is the one whose commits must be durable.
        fut = store._write(lambda c: c.execute("PRAGMA synchronous").fetchone()[0], True)
        assert fut is not None and await fut == PRAGMA_VALUE[mode]
    finally:
        await server.stop(0.1)
