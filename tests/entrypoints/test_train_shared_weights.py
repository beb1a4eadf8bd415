"""``rollout train``'s in-process weight sharing: the engine serves the trainer's own tensors (no
second copy), is paused while they change, and after ``publish`` samples from the changed
tensors under the new version label with its KV caches dropped."""

from __future__ import annotations

import pytest
import torch

from rollout.entrypoints.train import InProcessWeights
from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import SamplingParams
from rollout.server.llm.backend_pool import BackendPool
from rollout.server.llm.transformers_engine import TransformersEngine
from tests.fixtures.tiny_model import tiny_model_dir

pytestmark = pytest.mark.timeout(300)


def turn(prompt: list[int], session: str) -> GenerateRequest:
    return GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.0),
                           max_tokens=4, session_id=session)


async def test_engine_serves_the_policy_tensors_between_pause_and_publish() -> None:
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(tiny_model_dir(), num_threads=1, ignore_eos=True)
    pool = BackendPool([engine], health_interval_s=0)
    await pool.start()
    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    shared = InProcessWeights(pool)
    try:
        assert await shared.attach(policy)
        for (name, mine), theirs in zip(engine.model.named_parameters(), policy.parameters(),
                                        strict=True):
            assert mine.data_ptr() == theirs.data_ptr(), name  # one copy, not two
        prompt = engine.tokenizer.encode("the sandbox runs")
        before = await engine.generate(turn(prompt, "a"))
        assert engine.kv_store.nbytes == 0 or "a" in engine.kv_store
        await shared.pause()
        assert engine.paused and engine.kv_store.nbytes == 0
        with torch.no_grad():  # what the optimizer step does: change the tensors in place
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        await shared.publish(3)
        assert not engine.paused and engine.policy_version == 3
        after = await engine.generate(turn(prompt, "b"))
        assert after.policy_version == 3
        # The new turn is sampled from the changed tensors: its greedy logprobs are the
        # changed model's.
        ids = torch.tensor([prompt + after.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(policy(ids).logits[0].double(), -1)
        want = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(after.output_ids)]
        assert after.logprobs == pytest.approx(want, abs=1e-4)
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-4)
    finally:
        await pool.close()


async def test_a_model_of_another_dtype_is_not_shared() -> None:
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(tiny_model_dir(), num_threads=1)
    pool = BackendPool([engine], health_interval_s=0)
    await pool.start()
    try:
        other = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir()),
                                                     dtype=torch.bfloat16)
        assert not await InProcessWeights(pool).attach(other)
        with pytest.raises(ValueError, match="cannot share weights"):
            engine.share_weights(other)
    finally:
        await pool.close()
