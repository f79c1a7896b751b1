"""Write a model of random weights of a real shape as a real checkpoint: a safetensors folder or a GGUF file.

    python scripts/make_random_model.py OUT --format safetensors   # OUT/: config.json + 4 GiB bf16 shards (~15 GB)
    python scripts/make_random_model.py OUT.gguf --format gguf     # one F16 GGUF (~15 GB)
    python scripts/make_random_model.py OUT.gguf --format gguf --type q8_0   # Q8_0, as users download (~8 GB)
    python scripts/make_random_model.py OUT --format safetensors --shape qwen3-30b-a3b --layers 16
        # Qwen3-30B-A3B's layer (128 experts, top-8) and vocabulary, 16 of its 48 layers (~20 GB)

Shapes: ``qwen2.5-7b`` (default; safetensors or GGUF), ``qwen2.5-14b`` (safetensors or GGUF; ~30 GB) and
``qwen3-30b-a3b`` (a mixture of experts; safetensors).
``--layers N`` keeps the shape of every layer and N of them (a disk too small for the whole model).

For measuring a model larger than RAM end to end (loading, conversion, packing, quantizing, streaming) on a machine
without the real weights: tau means nothing with random weights, tokens/s against the disk's bound does. Neither
holds a tokenizer: run with token ids (scripts/first_start.py --prompt-ids). Written tensor by tensor (one tensor in
memory at a time). Delete the output when done: it is large and does not belong in the repository.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

QWEN25_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643,
                 eos_token_id=151645, hidden_act="silu", architectures=["Qwen2ForCausalLM"])


QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     bos_token_id=151643, eos_token_id=151645, hidden_act="silu", decoder_sparse_step=1,
                     mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"])
QWEN25_14B = dict(QWEN25_7B, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                  num_key_value_heads=8)


SHAPES = {"qwen2.5-7b": QWEN25_7B, "qwen2.5-14b": QWEN25_14B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def moe_tensors(c: dict):
    """(HF name, None, shape) of every tensor of a Qwen3-MoE model, in file order (no GGUF names)."""
    H, V, E, I = c["hidden_size"], c["vocab_size"], c["num_experts"], c["moe_intermediate_size"]
    hd = c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", None, (V, H)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("input_layernorm.weight", (H,)), ("self_attn.q_proj.weight", (q, H)),
                            ("self_attn.k_proj.weight", (kv, H)), ("self_attn.v_proj.weight", (kv, H)),
                            ("self_attn.o_proj.weight", (H, q)), ("self_attn.q_norm.weight", (hd,)),
                            ("self_attn.k_norm.weight", (hd,)), ("post_attention_layernorm.weight", (H,)),
                            ("mlp.gate.weight", (E, H))):
            yield p + name, None, shape
        for e in range(E):
            for n, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                yield f"{p}mlp.experts.{e}.{n}.weight", None, shape
    yield "model.norm.weight", None, (H,)
    yield "lm_head.weight", None, (V, H)


def tensors(c: dict):
    """(HF name, GGUF name, shape) of every tensor of a model of shape ``c``, in file order."""
    if c["model_type"] == "qwen3_moe":
        yield from moe_tensors(c)
        return
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = H // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", "token_embd.weight", (V, H)
    for i in range(c["num_hidden_layers"]):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        for hf, gg, shape in (("input_layernorm.weight", "attn_norm.weight", (H,)),
                              ("self_attn.q_proj.weight", "attn_q.weight", (H, H)),
                              ("self_attn.q_proj.bias", "attn_q.bias", (H,)),
                              ("self_attn.k_proj.weight", "attn_k.weight", (kv, H)),
                              ("self_attn.k_proj.bias", "attn_k.bias", (kv,)),
                              ("self_attn.v_proj.weight", "attn_v.weight", (kv, H)),
                              ("self_attn.v_proj.bias", "attn_v.bias", (kv,)),
                              ("self_attn.o_proj.weight", "attn_output.weight", (H, H)),
                              ("post_attention_layernorm.weight", "ffn_norm.weight", (H,)),
                              ("mlp.gate_proj.weight", "ffn_gate.weight", (I, H)),
                              ("mlp.up_proj.weight", "ffn_up.weight", (I, H)),
                              ("mlp.down_proj.weight", "ffn_down.weight", (H, I))):
            yield p + hf, g + gg, shape
    yield "model.norm.weight", "output_norm.weight", (H,)
    yield "lm_head.weight", "output.weight", (V, H)


def value(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, everything else N(0, 0.02) (biases N(0, 0.01)), float32."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    return torch.randn(shape, generator=gen) * (0.01 if name.endswith(".bias") else 0.02)


def write_safetensors(out: Path, c: dict, shard_bytes: int = 4 << 30) -> None:
    from subspec.tensorfile import TensorFileWriter

    out.mkdir(parents=True, exist_ok=True)
    items = list(tensors(c))
    shards, size = [[]], 0
    for hf, _, shape in items:
        n = 2 * int(np.prod(shape))
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((hf, shape))
        size += n
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, entries in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        w = TensorFileWriter(out / fname, [(n, torch.bfloat16, s) for n, s in entries], {"format": "pt"})
        for name, shape in entries:
            w.write(name, value(name, shape, gen))
            weight_map[name] = fname
        w.close()
        print(f"wrote {fname}", flush=True)
    total = sum(2 * int(np.prod(s)) for _, _, s in items)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps({**c, "torch_dtype": "bfloat16"}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": c["eos_token_id"]}))


def write_gguf(out: Path, c: dict, qtype: str = "f16") -> None:
    """One GGUF file: matrices in F16 or Q8_0 (``qtype``, quantized with the ``gguf`` package), norms and biases F32."""
    import gguf
    from gguf.quants import quantize

    q8 = qtype == "q8_0"

    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name(f"random-qwen2.5-{c['num_hidden_layers']}-layer-shape")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    items = list(tensors(c))
    for _, gg, shape in items:  # F16 or Q8_0 matrices; F32 norms and biases (as llama.cpp stores them)
        if q8 and len(shape) == 2:  # 34 bytes a block of 32 weights
            w.add_tensor_info(gg, (shape[0], shape[1] // 32 * 34), np.dtype(np.uint8), int(np.prod(shape)) // 32 * 34,
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            continue
        dt = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(gg, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    gen = torch.Generator().manual_seed(0)
    for hf, gg, shape in items:
        t = value(hf, shape, gen)
        if len(shape) == 1:
            w.write_tensor_data(t.numpy())
        elif q8:
            w.write_tensor_data(quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0))
        else:
            w.write_tensor_data(t.half().numpy())
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--format", choices=("safetensors", "gguf"), required=True)
    ap.add_argument("--type", choices=("f16", "q8_0"), default="f16", help="GGUF matrix type")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, help="keep N layers of the shape (default: all)")
    a = ap.parse_args()
    c = dict(SHAPES[a.shape], **({"num_hidden_layers": a.layers} if a.layers else {}))
    if a.format == "gguf":
        if c["model_type"] != "qwen2":
            raise SystemExit("make_random_model: GGUF output is written for the qwen2.5 shapes only")
        write_gguf(Path(a.out), c, a.type)
    else:
        write_safetensors(Path(a.out), c)


if __name__ == "__main__":
    main()
