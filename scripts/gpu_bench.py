"""CUDA host-tier benchmark on a Qwen2.5-7B-shaped random-weight model (run by scripts/gpu_check.sh).

Prints the measured pinned host-to-device bandwidth, plain offloaded decoding's seconds per target forward against
the bound (offloaded bytes / bandwidth), and SubSpec's draft-step and verify timings at the same budget.
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig

from subspec.loading import RandomSource
from subspec.placement import fmt_bytes, parse_bytes
from subspec.runtime import Options, load
from subspec.sampling import SamplingParams

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                 tie_word_embeddings=False, rms_norm_eps=1e-6)


def h2d_bandwidth(nbytes: int, repeats: int = 10) -> float:
    """Bytes/s of pinned host -> device copies of ``nbytes`` (cudaHostRegister'ed buffer, timed with events)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        dev.copy_(host, non_blocking=True)
    b.record()
    b.synchronize()
    return nbytes * repeats / (a.elapsed_time(b) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args()
    cfg = AutoConfig.for_model("qwen2", **QWEN25_7B)
    src = RandomSource(cfg)
    budget = parse_bytes(a.budget)
    common = dict(model="<random>", device="cuda", dtype="bfloat16", device_memory=budget, offload="host",
                  max_context=1024)
    ids = list(range(100, 164))
    ar = load(Options(method="ar", **common), source=src)
    bw = h2d_bandwidth(ar.placement.layer_bytes)
    ar.engine.generate(ids, SamplingParams(max_new_tokens=2))  # warm-up
    ar.engine.reset()
    torch.cuda.synchronize()
    t = time.perf_counter()
    ar.engine.generate(ids, SamplingParams(max_new_tokens=a.tokens))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    st = ar.engine.last_stats
    t_fwd = (dt - st.prefill_seconds) / max(st.target_forwards - 1, 1)
    bound = ar.placement.offloaded_bytes / bw
    print(f"ar: {ar.placement.summary()}")
    print(f"pinned H2D bandwidth {bw / 1e9:.1f} GB/s; t_forward {t_fwd:.3f} s; bound {bound:.3f} s; "
          f"t_forward / bound = {t_fwd / bound:.2f}; peak device memory {fmt_bytes(torch.cuda.max_memory_allocated())}")
    ar.close()
    del ar
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    spec = load(Options(method="subspec", depth=16, verify_budget=64, **common), source=src)
    spec.engine.generate(ids, SamplingParams(max_new_tokens=2))
    spec.engine.reset()
    spec.engine.generate(ids, SamplingParams(max_new_tokens=a.tokens))
    st = spec.engine.last_stats
    steps = st.draft_steps
    print(f"subspec: {spec.placement.summary()}")
    print(f"subspec: {st.rounds} rounds, draft {st.draft_seconds:.3f} s ({1e3 * st.draft_seconds / max(steps, 1):.1f} ms "
          f"per draft step), verify {st.verify_seconds / max(st.rounds, 1):.3f} s per round, tau {st.tau:.2f} "
          f"(random weights: meaningless); peak device memory {fmt_bytes(torch.cuda.max_memory_allocated())}")
    spec.close()


if __name__ == "__main__":
    main()
