"""The real Gemma 3 270M (GGUF) against transformers in FP32: logits past its 512-token sliding window, and greedy
``ar`` and ``subspec`` with most layers offloaded to disk, token-identical to transformers ``generate``."""
from __future__ import annotations

import pytest
import torch

from subspec.model import Attention
from subspec.runtime import Options, load
from subspec.sampling import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of three fruits:",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "import numpy as np\n\n# compute the mean of each row of a matrix\n",
    "Q: What is 17 times 23?\nA:",
    "The best way to learn a new language is",
    "Photosynthesis is the process by which",
]
LONG = "Chapter 1. " + " ".join(f"On day {i} the traveller walked to the {w} and wrote it down." for i, w in
                                 zip(range(1, 61), ["river", "mountain", "city", "forest", "harbour"] * 12))
"""A prompt longer than the 512-token sliding window of Gemma 3's local layers."""
NEW = 64
RESIDENT = 3  # of 18 layers: most offloaded


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(gemma3_gguf):
    """CI: one short prompt and the long one (past the 512-token window), 12 new tokens (the full check below is
    opt-in: ``-m heavy``)."""
    _check(gemma3_gguf, PROMPTS[:1], 12)


@pytest.mark.heavy
def test_gemma3_270m_ten_prompts_64_tokens(gemma3_gguf):
    """The issue's check: ten prompts (one past the sliding window) x 64 tokens, about 6 minutes on 2 cores."""
    _check(gemma3_gguf, PROMPTS, NEW)


def _check(gemma3_gguf, prompts_text: list[str], new: int) -> None:
    from transformers import AutoModelForCausalLM

    from subspec.loading import open_model
    from test_decoder import build

    src, dec, layers = build(open_model(gemma3_gguf, torch.float32).path)  # the weights load() uses below
    assert src.family.name == "gemma3_text" and 512 in dec.windows and 0 in dec.windows
    tok = src.tokenizer()
    prompts = [tok(p)["input_ids"] for p in prompts_text + [LONG]]
    assert len(prompts[-1]) > 512
    hf = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32).eval()
    with torch.no_grad():
        ids = prompts[-1]
        ref = hf(torch.tensor([ids])).logits[0]
        kv = dec.new_kv_cache(len(ids))
        pos = torch.arange(len(ids))
        ours = dec.forward(torch.tensor(ids), pos, pos, Attention.run(0), layers, kv)
        assert (ours - ref).abs().max().item() <= 1e-4  # every position, past the window
        refs = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=new, eos_token_id=src.eos_token_ids,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    del hf, layers, dec
    for method in ("ar", "subspec"):
        rt = load(Options(model=str(gemma3_gguf), method=method, device="cpu", dtype="float32", offload="disk",
                          max_resident=RESIDENT, max_context=1024, depth=8, topk=4, verify_budget=32))
        try:
            assert len(rt.placement.offloaded) == 18 - RESIDENT
            for p, want in zip(prompts, refs):
                rt.engine.reset()
                assert rt.engine.generate(p, SamplingParams(max_new_tokens=new)) == want, (method, tok.decode(p))
            if method == "subspec":
                assert rt.engine.last_stats.tau > 1
        finally:
            rt.close()
