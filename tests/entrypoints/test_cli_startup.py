"""The command line before any server answers: help, missing extras, piped tables."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rollout.entrypoints import cli
from rollout.entrypoints.cli import main
from rollout.server.config import ServerSection
from tests.client.conftest import ThreadedServer, task
from tests.util import scaled

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]

# A client-only install, simulated in a child process: the server extra's modules cannot be
# found or imported (sys.modules[name] = None makes both find_spec and import say so).
CLIENT_ONLY = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
from rollout.entrypoints.cli import main
code = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.startswith("rollout.server") and sys.modules[m])
print("server modules loaded:", loaded, file=sys.stderr)
raise SystemExit(code)
"""


def _client_only(*argv: str, blocked: tuple[str, ...] = ("grpc_health", "jupyter_client")
                 ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLIENT_ONLY.format(blocked=blocked), *argv],
                          capture_output=True, text=True, timeout=scaled(60), cwd=ROOT)


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("argv", [["serve"], ["quickstart"], ["llm-serve"], ["bench", "tools"],
                                  ["serve", "--port", "0"]])
def test_server_commands_name_the_extra_in_a_client_only_install(argv: list[str]) -> None:
    res = _client_only(*argv)
    assert res.returncode == 2, res.stderr
    err, loaded = res.stderr.rsplit("server modules loaded:", 1)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: FAILED_PRECONDITION MISSING_EXTRA: "), err
    assert f"`rollout {argv[0]}`" in err
    assert "grpcio-health-checking, jupyter-client" in err  # exactly the missing ones
    assert "pip install 'rollout-service[server]'" in err
    assert loaded.strip() == "[]", "nothing of the server was imported"


def test_client_commands_and_help_work_in_a_client_only_install() -> None:
    blocked = tuple(cli.SERVER_EXTRA)
    res = _client_only("bench", "--help", blocked=blocked)
    assert res.returncode == 0 and "pipeline" in res.stdout, res.stderr
    res = _client_only("status", "--address", "127.0.0.1:1", blocked=blocked)
    assert res.returncode == 2 and "error: UNAVAILABLE" in res.stderr  # the client ran
    assert res.stderr.rsplit("server modules loaded:", 1)[1].strip() == "[]"


def test_server_extra_table_matches_pyproject() -> None:
    """Each import name the CLI checks belongs to a distribution of the `server` extra, and
    every distribution of the extra is checked (pyproject and cli.py cannot drift apart)."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["server"]
    dists = {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower() for req in extra}
    assert set(cli.SERVER_EXTRA.values()) == dists
    owners = importlib.metadata.packages_distributions()
    for module, dist in cli.SERVER_EXTRA.items():
        assert dist in {d.lower().replace("_", "-") for d in owners.get(module, [])}, module


def test_missing_dependency_outside_the_extra_is_one_line(monkeypatch, capsys) -> None:
    def no_torch(argv: list[str]) -> int:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    import types

    mod = types.ModuleType("rollout.server.llm.http_server")
    mod.main = no_torch  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rollout.server.llm.http_server", mod)
    assert main(["llm-serve"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: FAILED_PRECONDITION MISSING_DEPENDENCY: No module named "
                          "'torch'; install it with: pip install torch") and err.count("\n") == 1


def test_bench_help(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name, text in cli.BENCHES.items():
        assert f"  {name:<9} {text}\n" in out


def test_serve_help_describes_every_flag_with_the_servers_defaults(capsys) -> None:
    serve = _subparser("serve")
    for action in serve._actions:
        assert action.help, f"{action.option_strings} has no description"
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    defaults = ServerSection()
    for flag, value in (("--host", defaults.host), ("--port", defaults.port),
                        ("--state-dir", defaults.state_dir),
                        ("--metrics-port", defaults.metrics_port),
                        ("--dashboard-port", defaults.dashboard_port)):
        assert re.search(rf"{flag} \S+ .*?\(default {re.escape(str(value))}[;,:) ]", text), flag


def test_tables_are_not_cut_when_piped(threaded_server: ThreadedServer, monkeypatch,
                                       capsys) -> None:
    """capsys is not a terminal, like a pipe; without COLUMNS rich would assume 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    long_id = "a-job-id-long-enough-to-push-the-row-past-eighty-columns-" + "x" * 40
    from rollout.client.sync import RolloutClientSync

    with RolloutClientSync(threaded_server.address) as client:
        for _ in client.submit_rollout({"job_id": long_id, **task(reward=0.5)}):
            pass
    assert main(["jobs", "list", "--address", threaded_server.address]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if long_id in line)
    assert len(row) > 120 and "…" not in out
    assert row.split()[1:3] == ["scripted", "SUCCEEDED"] and "0.500" in row
