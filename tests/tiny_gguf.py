"""Write a tiny Hugging Face checkpoint as a GGUF file the way llama.cpp's converter lays it out (F32 tensors): for the
mixture-of-experts families, whose small real GGUFs cannot be downloaded here.

- ``qwen3_moe`` -> architecture ``qwen3moe``: experts stacked per layer (``ffn_{gate,up,down}_exps``, [experts, out,
  in]), the router as ``ffn_gate_inp``, the expert width as ``expert_feed_forward_length``.
- ``mixtral`` -> architecture ``llama`` with ``expert_count`` (llama.cpp stores Mixtral so), q/k rows permuted as
  llama.cpp's converter does for llama models (transformers' GGUF loader undoes it).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives q/k weights [heads * head_dim, hidden] of llama models: per head,
    the two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, out: Path) -> Path:
    """``folder``: a tiny qwen3_moe or mixtral checkpoint (safetensors, untied). Returns ``out``."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(folder))
    w = {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}
    moe = c.model_type == "qwen3_moe"
    arch = "qwen3moe" if moe else "llama"
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    E = c.num_experts
    g = gguf.GGUFWriter(str(out), arch)
    g.add_context_length(c.max_position_embeddings)
    g.add_embedding_length(c.hidden_size)
    g.add_block_count(c.num_hidden_layers)
    g.add_feed_forward_length(c.intermediate_size)
    g.add_head_count(c.num_attention_heads)
    g.add_head_count_kv(c.num_key_value_heads)
    g.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    g.add_layer_norm_rms_eps(c.rms_norm_eps)
    g.add_vocab_size(c.vocab_size)
    g.add_expert_count(E)
    g.add_expert_used_count(c.num_experts_per_tok)
    g.add_rope_dimension_count(hd)
    if moe:
        g.add_key_length(hd)
        g.add_value_length(hd)
        g.add_expert_feed_forward_length(c.moe_intermediate_size)
    g.add_bos_token_id(c.bos_token_id)
    g.add_eos_token_id(c.eos_token_id)
    mlp = "mlp" if moe else "block_sparse_moe"
    names = ({"gate": "gate_proj", "up": "up_proj", "down": "down_proj"} if moe else
             {"gate": "w1", "up": "w3", "down": "w2"})
    g.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"]
        if not moe:
            q, k = _llama_permute(q, c.num_attention_heads), _llama_permute(k, c.num_key_value_heads)
        g.add_tensor(b + "attn_norm.weight", w[p + "input_layernorm.weight"])
        g.add_tensor(b + "attn_q.weight", q)
        g.add_tensor(b + "attn_k.weight", k)
        g.add_tensor(b + "attn_v.weight", w[p + "self_attn.v_proj.weight"])
        g.add_tensor(b + "attn_output.weight", w[p + "self_attn.o_proj.weight"])
        if moe:
            g.add_tensor(b + "attn_q_norm.weight", w[p + "self_attn.q_norm.weight"])
            g.add_tensor(b + "attn_k_norm.weight", w[p + "self_attn.k_norm.weight"])
        g.add_tensor(b + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"])
        g.add_tensor(b + "ffn_gate_inp.weight", w[f"{p}{mlp}.gate.weight"])
        for which, name in names.items():
            g.add_tensor(f"{b}ffn_{which}_exps.weight",
                         np.stack([w[f"{p}{mlp}.experts.{e}.{name}.weight"] for e in range(E)]))
    g.add_tensor("output_norm.weight", w["model.norm.weight"])
    g.add_tensor("output.weight", w["lm_head.weight"])
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return out
