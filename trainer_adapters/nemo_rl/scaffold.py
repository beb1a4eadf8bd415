"""Write the server directory NeMo Gym launches the Rollout Service agent from.

NeMo Gym starts each server of its config from ``responses_api_agents/<name>/`` (looked up in
the working directory first), builds that directory's venv from its ``requirements.txt`` and
runs its ``entrypoint`` there. This writes such a directory whose ``app.py`` runs
:class:`rollout.trainer_adapters.nemo_rl.gym_agent.RolloutServiceAgent`, plus a config to list
in NeMo Gym's ``config_paths`` (the agent and its environment server), and a
``requirements.txt`` that installs this package from its checkout or a wheel (it is not
published on PyPI)::

    python -m rollout.trainer_adapters.nemo_rl.scaffold [ROOT] [--address HOST:PORT] \
        [--requirement PATH_OR_WHEEL]

Plain Python (no nemo-gym import), so it runs wherever the package is installed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

AGENT_NAME = "rollout_service_agent"

APP = '''"""NeMo Gym entrypoint: the Rollout Service as an agent server (written by
rollout.trainer_adapters.nemo_rl.scaffold)."""

from rollout.trainer_adapters.nemo_rl.gym_agent import RolloutServiceAgent

if __name__ == "__main__":
    RolloutServiceAgent.run_webserver()
'''

CONFIG = """{name}:
  responses_api_agents:
    {name}:
      entrypoint: app.py
      address: {address}
      environment: {environment}
      max_turns: {max_turns}
{env_server}:
  environment_servers:
    legacy_agent:
      entrypoint: app.py
      agent_server:
        type: responses_api_agents
        name: {name}
"""
"""An agent and the environment server through which Gym's rollout collection reaches it
(nemo-gym 0.7 flags an agent without one as deprecated and generates this relay itself)."""

ENV_SERVER_NAME = "rollout_service_environment_server"


def source_requirement() -> str:
    """What pip installs this package from: the checkout it runs from. The package is not on
    PyPI, so its name alone would not install; from a built wheel, pass the wheel instead."""
    root = Path(__file__).resolve().parents[2]  # trainer_adapters/nemo_rl/scaffold.py
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "rollout-service"' in pyproject.read_text():
        return str(root)
    raise ValueError("this package was not installed from a checkout (no pyproject.toml above "
                     "it); pass requirement= (--requirement) with the path or URL of the "
                     "rollout-service wheel or checkout the agent's venv should install")


def scaffold(root: Path, *, address: str = "127.0.0.1:50051", environment: str = "math",
             max_turns: int = 8, requirement: str | None = None) -> Path:
    """Write ``ROOT/responses_api_agents/rollout_service_agent/`` and return it.

    ``requirement`` is the pip requirement the agent's venv installs this package from (a
    checkout directory, a wheel file or URL); by default the checkout this runs from."""
    server_dir = Path(root) / "responses_api_agents" / AGENT_NAME
    (server_dir / "configs").mkdir(parents=True, exist_ok=True)
    (server_dir / "app.py").write_text(APP)
    # The agent's venv needs nemo-gym (Gym installs it for its servers) and this package.
    (server_dir / "requirements.txt").write_text(f"{requirement or source_requirement()}\n")
    (server_dir / "configs" / f"{AGENT_NAME}.yaml").write_text(CONFIG.format(
        name=AGENT_NAME, address=address, environment=environment, max_turns=max_turns,
        env_server=ENV_SERVER_NAME))
    return server_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default=".", type=Path)
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--environment", default="math")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--requirement", default=None,
                        help="what the agent's venv pip-installs this package from (a wheel "
                        "or checkout path); default: the checkout this runs from")
    args = parser.parse_args(argv)
    out = scaffold(args.root, address=args.address, environment=args.environment,
                   max_turns=args.max_turns, requirement=args.requirement)
    print(out)


if __name__ == "__main__":
    main()
