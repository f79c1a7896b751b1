"""Every supported family against transformers (FP32), on tiny random configs.

Per case: logits at every position of a context longer than any sliding window (one prefill, and one token at a
time through the cache) within 1e-4 of transformers; then greedy ``ar`` and ``subspec`` with all layers but the first
offloaded to the disk tier, token-identical to transformers ``generate``. The cases cover RoPE scaling (llama3,
yarn, linear, and Gemma 3's two bases), tied and untied embeddings, attention bias, sliding windows (Mistral, Qwen2
and Qwen3 with ``use_sliding_window``, Gemma 3's local layers), a multimodal Gemma 3 checkpoint's text part, and the
mixture-of-experts families (Qwen3-MoE with and without renormalized routing weights, Mixtral with its own
checkpoint names and a router of fewer rows than the native linear's multiple).
"""
from __future__ import annotations

import pytest
import torch

from subspec.model import Attention
from subspec.runtime import Options, load
from subspec.sampling import SamplingParams

from conftest import save_tiny, tiny_config
from test_decoder import build, linear_logits

WINDOW = 6
PROMPT = [5, 17, 3, 99, 42, 8, 64, 120, 7, 11, 30, 13]
NEW = 30  # prompt + new tokens = 42, seven windows

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, sliding_window_pattern=2, layers=4,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
SLIDING = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
QWEN3_MOE = dict(head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3)
MIXTRAL = dict(intermediate_size=32, num_local_experts=6, num_experts_per_tok=2)

CASES = {
    "llama-llama3-untied": ("llama", False, dict(rope_scaling=LLAMA3)),
    "llama-linear-tied-bias": ("llama", True, dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                   attention_bias=True)),
    "mistral-window-untied": ("mistral", False, dict(sliding_window=WINDOW)),
    "qwen2-window-tied": ("qwen2", True, SLIDING),
    "qwen2-yarn-untied": ("qwen2", False, dict(rope_scaling=YARN)),
    "qwen3-tied": ("qwen3", True, {}),
    "qwen3-window-untied-bias": ("qwen3", False, dict(SLIDING, attention_bias=True)),
    "gemma3_text-tied": ("gemma3_text", True, GEMMA),
    "gemma3_text-yarn-untied-bias": ("gemma3_text", False, dict(GEMMA, attention_bias=True, rope_parameters={
        "full_attention": dict(YARN, rope_theta=1e6), "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma3-multimodal": ("gemma3", True, GEMMA),
    "qwen3_moe-tied-normalized": ("qwen3_moe", True, dict(QWEN3_MOE, norm_topk_prob=True)),
    "qwen3_moe-window-untied": ("qwen3_moe", False, dict(QWEN3_MOE, **SLIDING)),
    "mixtral-window-untied": ("mixtral", False, dict(MIXTRAL, sliding_window=WINDOW)),
}


def case_config(model_type: str, tied: bool, extra: dict):
    """The tiny config of a case; ``gemma3`` wraps a tiny Gemma 3 text config with a tiny SigLIP vision tower."""
    if model_type != "gemma3":
        return tiny_config(model_type, tied, **extra)
    from transformers import AutoConfig

    text = tiny_config("gemma3_text", tied, **extra)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return AutoConfig.for_model("gemma3", text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=1,
                                tie_word_embeddings=tied)


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(tmp_path, case):
    from transformers import AutoModelForCausalLM

    model_type, tied, extra = CASES[case]
    path = save_tiny(tmp_path / "m", case_config(model_type, tied, extra))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    src, dec, layers = build(path)
    L = dec.n_layers
    assert (dec.lm_head.data_ptr() == dec.embed.data_ptr()) == tied
    window = extra.get("sliding_window")
    assert window is None or (window in dec.windows and len(PROMPT) + NEW > 3 * window)

    hf.generation_config.eos_token_id = None  # generate exactly NEW tokens (ours: no EOS below)
    with torch.no_grad():
        ref_new = hf.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
        ids = PROMPT + ref_new[:-1]
        ref = hf(torch.tensor([ids])).logits[0]
    kv = dec.new_kv_cache(64)
    pos = torch.arange(len(ids))
    ours = dec.forward(torch.tensor(ids), pos, pos, Attention.run(0), layers, kv)
    assert (ours - ref).abs().max().item() <= 1e-4
    step, _ = linear_logits(dec, layers, ids)
    assert (step - ref).abs().max().item() <= 1e-4

    params = SamplingParams(max_new_tokens=NEW)
    for method in ("ar", "subspec"):
        rt = load(Options(model=str(path), method=method, device="cpu", dtype="float32", offload="disk",
                          max_resident=1, max_context=64, depth=4, topk=3, verify_budget=12, group_size=32), src)
        try:
            assert rt.placement.offloaded == list(range(L - 1)) and rt.tier is not None  # the last layer resident
            rt.engine.eos = set()
            out = rt.engine.generate(PROMPT, params)
            assert out == ref_new, method
            st = rt.engine.last_stats
            # the offloaded layers were read from disk for every target forward (the first ones maybe before it): whole
            # layers; of a mixture of experts, the attention and at least the top-k experts, never all of them
            units, moe = rt.tier.layout.units, src.family.moe
            least = rt.placement.layer_bytes if moe is None else units[0][1] + moe.top_k(src.config) * units[1][1]
            assert st.bytes_streamed >= (L - 1) * least * (st.target_forwards - 1)
            if moe is not None and method == "ar":  # one token a forward after the prefill (at most every expert)
                whole = rt.placement.layer_bytes        # reads its attention and exactly its top-k experts
                assert st.bytes_streamed <= (L - 1) * (least * (st.target_forwards - 1) + whole)
            if method == "subspec":
                assert st.accepted_tokens > 0 and st.target_forwards < NEW  # trees were drafted and verified
        finally:
            rt.close()


def test_our_activations_are_transformers_bit_for_bit():
    """The gated MLP's activations the decoder takes without importing transformers.activations (3 s of a start)
    give ACT2FN's bits in float32 and bfloat16; another name comes from ACT2FN; an unknown one is a one-line error."""
    from transformers.activations import ACT2FN

    from subspec.errors import SubspecError
    from subspec.model import _ACTIVATIONS, activation

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    for name in _ACTIVATIONS:
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(activation(name)(x.to(dtype)), ACT2FN[name](x.to(dtype))), (name, dtype)
    assert torch.equal(activation("relu")(x), ACT2FN["relu"](x))
    with pytest.raises(SubspecError, match="unsupported activation 'nope'"):
        activation("nope")
