"""Sparse upcycling (Komatsuzaki et al. 2023): a real dense llama-family model turned into a Mixtral-style mixture of
experts, to measure MoE offloading with real weights (no small real MoE checkpoint can be downloaded here).

    python scripts/upcycle_moe.py MODEL OUT [--experts 8] [--top-k 2] [--noise 0.05] [--router-std 0.02]

MODEL: a llama-family Hugging Face folder or GGUF file (e.g. SmolLM2-135M: ``../shared/scripts/get-model
smollm2-135m``). OUT: a Mixtral safetensors folder (BF16, Mixtral's checkpoint names, the tokenizer copied), which
transformers and subspec both open. Every layer's gated MLP becomes ``--experts`` experts, expert e being the MLP's
three matrices plus Gaussian noise of ``--noise`` times each matrix's standard deviation (seeded by layer and expert),
so the experts differ a little and the model still speaks like the dense one (each token's output is the
renormalized top-k mix of near-copies of the MLP). The router's rows are random Gaussian (``--router-std``): the
hidden states are far from isotropic, so routing is far from uniform; the script prints the measured share of the
most and least used experts over a few prompts. Attention, norms and embeddings are the dense model's.

What it makes of tau: the draft's substitutes are 4-bit copies of experts that are near-copies of one MLP, so the
acceptance is about the dense model's; the routing (which experts a tree touches) is real enough to measure bytes.
Delete the output when done: it does not belong in the repository.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

PROMPTS = ["Write a haiku about the sea.", "def fibonacci(n):", "What is the capital of France?",
           "Explain what a hash table is."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.05, help="expert noise, in units of each matrix's std")
    ap.add_argument("--router-std", type=float, default=0.02)
    ap.add_argument("--no-measure", dest="measure", action="store_false", help="skip the routing measurement")
    a = ap.parse_args()

    from subspec.loading import open_model
    from subspec.tensorfile import TensorFileWriter

    src = open_model(a.model)
    c = src.config
    if c.model_type not in ("llama", "mistral"):
        raise SystemExit(f"upcycle_moe: {c.model_type} is not a llama-family model (Mixtral has llama attention)")
    E, L, H, I = a.experts, c.num_hidden_layers, c.hidden_size, c.intermediate_size
    tied = bool(getattr(c, "tie_word_embeddings", False)) or not src.has("lm_head.weight")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    entries = [("model.embed_tokens.weight", (c.vocab_size, H)), ("model.norm.weight", (H,))]
    if not tied:
        entries.append(("lm_head.weight", (c.vocab_size, H)))
    plan = []  # (name written, source name or None, shape, layer, expert)
    for i in range(L):
        p = f"model.layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            plan.append((p + n, p + n, (H,), i, None))
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"{p}self_attn.{n}.weight"
            plan.append((name, name, tuple(src.tensor(name).shape), i, None))
        plan.append((f"{p}block_sparse_moe.gate.weight", None, (E, H), i, None))
        for e in range(E):
            for w, n, shape in (("w1", "gate_proj", (I, H)), ("w2", "down_proj", (H, I)), ("w3", "up_proj", (I, H))):
                plan.append((f"{p}block_sparse_moe.experts.{e}.{w}.weight", f"{p}mlp.{n}.weight", shape, i, e))
    entries += [(name, shape) for name, _, shape, _, _ in plan]
    with TensorFileWriter(out / "model.safetensors", [(n, torch.bfloat16, s) for n, s in entries],
                          {"format": "pt"}) as f:
        f.write("model.embed_tokens.weight", src.tensor("model.embed_tokens.weight").bfloat16())
        f.write("model.norm.weight", src.tensor("model.norm.weight").bfloat16())
        if not tied:
            f.write("lm_head.weight", src.tensor("lm_head.weight").bfloat16())
        for name, source, shape, i, e in plan:
            if source is None:  # a router
                g = torch.Generator().manual_seed(1_000 + i)
                f.write(name, (torch.randn(shape, generator=g) * a.router_std).bfloat16())
                continue
            w = src.tensor(source).float()
            if e is not None:
                g = torch.Generator().manual_seed(10_000 * (i + 1) + e)
                w = w + torch.randn(w.shape, generator=g) * (a.noise * w.std())
            f.write(name, w.bfloat16())
    cfg = {k: v for k, v in c.to_dict().items() if k not in ("architectures", "model_type", "transformers_version",
                                                              "mlp_bias", "pretraining_tp", "_name_or_path")}
    cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=E,
               num_experts_per_tok=a.top_k, sliding_window=None, router_jitter_noise=0.0, dtype="bfloat16",
               tie_word_embeddings=tied)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for n in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "special_tokens_map.json"):
        if (src.path / n).exists():
            shutil.copy(src.path / n, out / n)
    print(f"wrote {out}: {L} layers x {E} experts (top-{a.top_k}), "
          f"{sum(torch.Size(s).numel() for _, s in entries) / 1e9:.2f} B parameters")
    if a.measure:
        routing_share(out, a.experts)


def routing_share(path: Path, experts: int) -> None:
    """Print how often each layer's experts are routed to over :data:`PROMPTS`: the most and least used expert's
    share, averaged over layers (uniform routing: 1 / experts each)."""
    from subspec.runtime import Options, load
    from subspec.sampling import SamplingParams

    rt = load(Options(model=str(path), method="ar", dtype="bfloat16", offload="none", max_context=256))
    try:
        dec, moe = rt.decoder, rt.decoder.moe
        counts = torch.zeros(dec.n_layers, experts)

        def counting(i, x, lin):
            counts[i].add_(torch.bincount(dec.routers[i](x)[1].reshape(-1), minlength=experts).float())
            return moe(i, x, lin)

        dec.moe = counting
        for p in PROMPTS:
            rt.engine.reset()
            rt.engine.generate(rt.encode(p), SamplingParams(max_new_tokens=16))
        share = (counts / counts.sum(1, keepdim=True)).sort(1, descending=True).values
        print(f"routing over {len(PROMPTS)} prompts, per layer: most used expert {share[:, 0].mean():.1%}, least used "
              f"{share[:, -1].mean():.1%} (uniform {1 / experts:.1%}; averaged over {dec.n_layers} layers)")
    finally:
        rt.close()


if __name__ == "__main__":
    main()
