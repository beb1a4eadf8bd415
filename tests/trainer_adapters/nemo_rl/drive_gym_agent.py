"""Runs inside .venv-nemo-gym: the Gym agent's real FastAPI app, called over ASGI.

Usage: drive_gym_agent.py REQUEST.json RESULT.json. For each row of the request it posts
``/run``, validates the answer with nemo-gym's own pydantic models, flattens it the way NeMo
RL's Gym path does (``nemo_flatten``, restated from ``nemo_rl/environments/nemo_gym.py``), and
converts the job's stored trajectory with ``to_message_log``; it also posts
``/aggregate_metrics`` and one ``/v1/responses``. The test in the main environment compares all
of it with what the tasks spell out and with a hand-derived fixture.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def nemo_flatten(gym_result: dict[str, Any]) -> list[dict[str, Any]]:
    """NeMo RL's Gym postprocessing, restated: items without generation tokens are skipped;
    each call's prompt must extend every token seen so far (else NeMo RL raises
    "Non-contiguous messages found"); the new prompt part becomes a user message, the generation
    an assistant message; GRPO then masks the loss to assistant tokens."""
    log: list[dict[str, Any]] = []
    seen: list[int] = []
    for item in gym_result["response"]["output"]:
        if "generation_token_ids" not in item:
            continue
        prompt = item["prompt_token_ids"]
        assert prompt[:len(seen)] == seen, "Non-contiguous messages found!"
        user = prompt[len(seen):]
        gen = item["generation_token_ids"]
        log.append({"role": "user", "content": "", "token_ids": user,
                    "token_loss_mask": [0] * len(user)})
        log.append({"role": "assistant", "content": "", "token_ids": gen,
                    "token_loss_mask": [1] * len(gen),
                    "generation_logprobs": item["generation_log_probs"]})
        seen = seen + user + gen
    return log


def nemo_rl_loss_multiplier(gym_results: list[dict[str, Any]]) -> list[float]:
    """NeMo RL's sample masking, restated (NeMo RL is not installable here; read from
    NVIDIA-NeMo/RL at 7ea279ab): ``_extract_mask_sample_flags`` (nemo_rl/experience/
    rollouts.py) reads ``full_result["instance_config"]["mask_sample"]``, defaulting to False,
    where ``full_result`` is the agent's /run answer; ``_apply_mask_sample_filter``
    (nemo_rl/algorithms/grpo.py) sets ``loss_multiplier`` to 0 where it is True. Anything else
    in the answer (a top-level ``mask_sample`` included) is not read."""
    flags = [bool((r.get("instance_config") or {}).get("mask_sample", False))
             for r in gym_results]
    return [0.0 if flag else 1.0 for flag in flags]


async def groups(req: dict[str, Any]) -> dict[str, Any]:
    """Each group's rows posted at once (as NeMo RL does); NeMo RL's masking, its grouping
    key (each answer's first message's tokens, as NeMo RL's Gym path builds it) and its GRPO
    advantage (``nemo_rl_advantage.py``) over the answers, in each estimator setting."""
    import httpx
    from nemo_gym.server_utils import BaseServerConfig, ServerClient
    from omegaconf import DictConfig

    from rollout.trainer_adapters.nemo_rl.gym_agent import (
        RolloutServiceAgent,
        RolloutServiceAgentConfig,
    )

    sys.path.insert(0, str(Path(__file__).parent))
    from nemo_rl_advantage import nemo_rl_advantages

    config = RolloutServiceAgentConfig(host="127.0.0.1", port=0, entrypoint="gym_agent.py",
                                       name="rollout_service_agent", address=req["address"],
                                       environment="episode")
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
                          global_config_dict=DictConfig({}))
    app = RolloutServiceAgent(config=config, server_client=client).setup_webserver()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://agent", timeout=120) as http:
        replies = await asyncio.gather(*(http.post("/run", json=r) for r in req["rows"]))
    bodies = [r.json() for r in replies]
    keys = [tuple(nemo_flatten(b)[0]["token_ids"]) for b in bodies]
    rewards = [float(b["reward"]) for b in bodies]
    return {"rewards": rewards, "loss_multiplier": nemo_rl_loss_multiplier(bodies),
            "keys": [list(k) for k in keys],
            "advantages": {f"{loo}-{norm}": nemo_rl_advantages(keys, rewards, leave_one_out=loo,
                                                               normalize=norm)
                           for loo in (True, False) for norm in (True, False)}}


async def main(req: dict[str, Any]) -> dict[str, Any]:
    if req.get("groups"):
        return await groups(req)
    import httpx
    from nemo_gym.base_resources_server import (
        BaseMultiRewardVerifyResponse,
        BaseVerifyResponse,
    )
    from nemo_gym.config_types import AggregateMetrics
    from nemo_gym.openai_utils import (
        NeMoGymResponse,
        NeMoGymResponseFunctionToolCallForTraining,
        NeMoGymResponseOutputMessageForTraining,
    )
    from nemo_gym.server_utils import BaseServerConfig, ServerClient
    from omegaconf import DictConfig

    from rollout.client.aio import RolloutClient
    from rollout.trainer_adapters.nemo_rl.gym_agent import (
        RolloutServiceAgent,
        RolloutServiceAgentConfig,
    )
    from rollout.trainer_adapters.nemo_rl.message_log import to_message_log

    config = RolloutServiceAgentConfig(host="127.0.0.1", port=0, entrypoint="gym_agent.py",
                                       name="rollout_service_agent", address=req["address"],
                                       environment="episode",
                                       reward_components=req.get("reward_components", []),
                                       max_total_sequence_length=req.get(
                                           "max_total_sequence_length", 0),
                                       max_response_tokens=req.get("max_response_tokens", 0))
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
                          global_config_dict=DictConfig({}))
    agent = RolloutServiceAgent(config=config, server_client=client)
    app = agent.setup_webserver()
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://agent", timeout=60) as http, \
            RolloutClient(req["address"]) as service:
        for row in req["rows"]:
            resp = await http.post("/run", json=row)
            if resp.status_code != 200:
                results.append({"status": resp.status_code, "body": resp.text})
                continue
            body = resp.json()
            # nemo-gym's own models accept it: the verify response, the multi-reward variant,
            # the Responses-API response, and each token-carrying item as its training class.
            BaseVerifyResponse.model_validate(body)
            BaseMultiRewardVerifyResponse.model_validate(body)
            NeMoGymResponse.model_validate(body["response"])
            for item in body["response"]["output"]:
                if "generation_token_ids" in item:
                    cls = (NeMoGymResponseFunctionToolCallForTraining
                           if item["type"] == "function_call"
                           else NeMoGymResponseOutputMessageForTraining)
                    cls.model_validate(item)
            stored = await service.get_job(body["rollout_job_id"], include_trajectory=True)
            results.append({"status": 200, "body": body,
                            "nemo_flatten": nemo_flatten(json.loads(json.dumps(body))),
                            "message_log": to_message_log(stored.trajectory),
                            "budget": stored.job.spec.sampling.total_token_budget,
                            "response_budget": stored.job.spec.sampling.max_response_tokens,
                            "loss_multiplier": nemo_rl_loss_multiplier([body])[0]})
        ok = [r["body"] for r in results if r["status"] == 200]
        agg = await http.post("/aggregate_metrics", json={"verify_responses": ok})
        AggregateMetrics.model_validate(agg.json())
        responses = await http.post("/v1/responses", json={
            "input": [{"role": "user", "content": "hi"}],
            "metadata": {"rollout_task": json.dumps(req["rows"][0]["rollout_task"])}})
        NeMoGymResponse.model_validate(responses.json())
    return {"results": results, "aggregate": agg.json(), "responses": responses.json(),
            "scaffold": check_scaffold(Path(req["scaffold_root"]), req["address"])}


def check_scaffold(root: Path, address: str) -> dict[str, Any]:
    """The directory NeMo Gym would launch: its config validates as the agent's config (with
    the host, port and name Gym adds) and passes nemo-gym's own config parser with agents
    without an environment server made an error (what it otherwise flags as deprecated); its
    app.py compiles and names the agent; the agent asks Gym for no Ray cluster."""
    from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
    from nemo_gym.server_utils import _server_uses_ray
    from omegaconf import DictConfig, OmegaConf

    from rollout.trainer_adapters.nemo_rl.gym_agent import (
        RolloutServiceAgent,
        RolloutServiceAgentConfig,
    )
    from rollout.trainer_adapters.nemo_rl.scaffold import AGENT_NAME, scaffold

    server_dir = scaffold(root, address=address, environment="episode")
    config_path = server_dir / "configs" / f"{AGENT_NAME}.yaml"
    cfg = OmegaConf.to_container(OmegaConf.load(config_path))
    entry = cfg[AGENT_NAME]["responses_api_agents"][AGENT_NAME]
    config = RolloutServiceAgentConfig.model_validate(
        {**entry, "host": "127.0.0.1", "port": 1, "name": AGENT_NAME})
    initial = DictConfig({**GlobalConfigDictParserConfig.NO_MODEL_GLOBAL_CONFIG_DICT,
                          "config_paths": [str(config_path)],
                          "error_on_agent_without_environment_server": True})
    parsed = GlobalConfigDictParser().parse(GlobalConfigDictParserConfig(
        initial_global_config_dict=initial, skip_load_from_cli=True,
        skip_load_from_dotenv=True, offline=True))
    app = (server_dir / "app.py").read_text()
    compile(app, str(server_dir / "app.py"), "exec")
    return {"address": config.address, "environment": config.environment,
            "entrypoint": config.entrypoint, "runs_agent": "RolloutServiceAgent.run_webserver()"
            in app, "requirements": (server_dir / "requirements.txt").read_text().split(),
            "parsed_servers": sorted(k for k in parsed if k.startswith("rollout_service")),
            "uses_ray": _server_uses_ray(RolloutServiceAgent)}


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    result = asyncio.run(main(request))
    Path(sys.argv[2]).write_text(json.dumps(result))
