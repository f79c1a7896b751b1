"""Plain decoding ("ar") against transformers generate, and the loop's EOS / limit handling."""
from __future__ import annotations

import pytest
import torch

from subspec.engine import Engine, NoDraft
from subspec.sampling import SamplingParams

from test_decoder import build

PROMPTS = [
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three fruits:",
    "What is 17 times 23?",
    "Once upon a time, in a small village,",
]


@pytest.mark.slow
def test_greedy_ar_equals_transformers_generate(smollm2_dir):
    from transformers import AutoModelForCausalLM

    src, dec, layers = build(smollm2_dir)
    tok = src.tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    engine = Engine(dec, layers, NoDraft(), src.eos_token_ids, max_context=256)
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, min_new_tokens=0,
                              eos_token_id=src.eos_token_ids, pad_token_id=src.eos_token_ids[0])[0, len(ids):].tolist()
        engine.reset()
        ours = engine.generate(ids, SamplingParams(max_new_tokens=64))
        assert ours == ref, prompt


def test_eos_and_limit_cut_and_chat_continuation(tmp_path):
    """The loop stops at the first EOS (kept) or at max_new_tokens, and a second turn continues the cache exactly."""
    from conftest import save_tiny, tiny_config

    path = save_tiny(tmp_path / "m", tiny_config("llama", True, vocab=32))
    src, dec, layers = build(path)
    eng = Engine(dec, layers, NoDraft(), [], max_context=128)
    free = eng.generate([3, 4, 5], SamplingParams(max_new_tokens=20))
    assert len(free) == 20 and eng.last_stats.target_forwards == 20 and eng.last_stats.tau == 1.0
    stop = free[7]
    first = free.index(stop)
    eng2 = Engine(dec, layers, NoDraft(), [stop], max_context=128)
    cut = eng2.generate([3, 4, 5], SamplingParams(max_new_tokens=20))
    assert cut == free[:first + 1] and eng2.last_stats.new_tokens == first + 1
    # chat: the second turn continues after the first; equal to one run over the concatenation
    eng.reset()
    a = eng.generate([3, 4, 5], SamplingParams(max_new_tokens=6))
    b = eng.generate([9, 10], SamplingParams(max_new_tokens=6))
    eng.reset()
    whole = eng.generate([3, 4, 5] + a + [9, 10], SamplingParams(max_new_tokens=6))
    assert b == whole


def test_prompt_longer_than_a_prefill_chunk_equals_transformers(tmp_path):
    """Prefill runs in chunks of PREFILL_CHUNK tokens (the planned workspace): the result is transformers' own."""
    from transformers import AutoModelForCausalLM

    from conftest import save_tiny, tiny_config
    from subspec.placement import PREFILL_CHUNK

    path = save_tiny(tmp_path / "m", tiny_config("qwen2", False, vocab=64))
    src, dec, layers = build(path)
    prompt = [(7 * i + 3) % 61 + 2 for i in range(PREFILL_CHUNK + 45)]
    eng = Engine(dec, layers, NoDraft(), [], max_context=400)
    ours = eng.generate(prompt, SamplingParams(max_new_tokens=8))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref
