"""The embedded-model cache (convert once, atomically, under a lock) and the bench smoke run."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from rollout.benchmarks import llm as bench_llm
from rollout.server.llm import smollm2


def test_conversion_runs_once_under_concurrency(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    started = threading.Event()

    def fake_convert(_gguf: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        started.set()
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "_convert", fake_convert)
    monkeypatch.setattr(smollm2, "gguf_path", lambda: Path("/unused.gguf"))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(smollm2.smollm2_dir(tmp_path)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert len(set(results)) == 1 and (results[0] / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".SmolLM2") and p.is_dir()]


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(_gguf: Path, out_dir: Path) -> None:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "_convert", broken)
    monkeypatch.setattr(smollm2, "gguf_path", lambda: Path("/unused.gguf"))
    with pytest.raises(RuntimeError):
        smollm2.smollm2_dir(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [".SmolLM2-135M-Instruct.lock"]


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUT_CACHE_DIR", str(tmp_path))
    assert smollm2.default_cache_dir() == tmp_path


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_real_smollm2_loads_with_chat_template() -> None:
    """Converts on first use (~20 s), then loads from the cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = smollm2.smollm2_dir()
    tokenizer: Any = AutoTokenizer.from_pretrained(directory)
    ids: Any = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                        add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30


@pytest.mark.timeout(120)
def test_bench_llm_runs(tiny_dir: Path, capsys: pytest.CaptureFixture[str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    assert bench_llm.main(["--model", str(tiny_dir), "--tokens", "4", "--concurrency", "4",
                           "--turns", "3", "--balance-requests", "40", "--sampler-vocab",
                           "2000", "--sampler-batch", "8", "--only", "batching", "kv",
                           "prefill", "balance", "sampler"]) == 0
    out = capsys.readouterr().out
    for row in ("(a) batching", "(b) KV reuse", "(c) balance", "(d) cached prefill",
                "(e) sampler"):
        assert row in out
