"""Where one SubSpec round spends its time: a draft step and verify forwards, broken down by operator.

Usage: python scripts/profile_round.py --model M --device-memory SIZE [--dtype bfloat16] [--topk 6] [--steps 20]
       [--staging-slots N]

Loads the model as `subspec generate` would, prefills a prompt, then profiles (torch.profiler, CPU) ``--steps`` draft
steps of ``--topk`` rows and verify forwards of 1, 32 and 128 tree nodes through the real offload tier. Prints per
draft step: time by operator group (4-bit substitute linears, dense linears, attention, lm_head, top-k/softmax,
other ops, and the Python/dispatch overhead that no operator accounts for), and the floor: bytes of weights the
step reads / the measured RAM bandwidth.
"""
from __future__ import annotations

import argparse
import time

from subspec.process import use_huge_pages

use_huge_pages()  # as `subspec generate` does before torch allocates (process.py: the draft step's weights in huge pages)

import torch  # noqa: E402


def _group(name: str) -> str:
    if "linear_w4" in name or "int4pack" in name or "layers_w4" in name:
        return "4-bit substitute linears"
    if "linear_coded" in name:
        return "coded linears (decode + BF16)"
    if "linear_bf16" in name or name in ("aten::linear", "aten::addmm", "aten::mm"):
        return "dense linears (+lm_head)"
    if "tree_attention" in name or "scaled_dot_product" in name or "flash" in name:
        return "attention"
    if name in ("aten::topk", "aten::logsumexp", "aten::log_softmax", "aten::_log_softmax", "aten::softmax"):
        return "top-k / softmax"
    return "other operators"


def profile(fn, steps: int) -> tuple[float, dict[str, float]]:
    """Wall seconds per call (the median of ``steps`` calls timed one by one: a virtual machine's stolen milliseconds
    move a mean) and self CPU seconds per call by operator group (outermost operators only)."""
    import statistics

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    wall = statistics.median(times)
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    groups: dict[str, float] = {}
    for ev in prof.key_averages():
        groups[_group(ev.key)] = groups.get(_group(ev.key), 0.0) + ev.self_cpu_time_total / 1e6 / steps
    return wall, groups


def main() -> None:
    from subspec.machine import ram_read_rate
    from subspec.model import Attention
    from subspec.placement import fmt_bytes, parse_bytes
    from subspec.runtime import Options, load

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device-memory", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-native-kernels", action="store_true")
    ap.add_argument("--staging-slots", type=int, help="staging slots of the disk tier (default: the plan's choice)")
    args = ap.parse_args()
    rt = load(Options(model=args.model, device_memory=parse_bytes(args.device_memory), dtype=args.dtype,
                      topk=args.topk, depth=8, verify_budget=128, max_context=1024,
                      native_kernels=not args.no_native_kernels, staging_slots=args.staging_slots))
    eng, draft, dec = rt.engine, rt.draft, rt.decoder
    print(f"placement: {rt.placement.summary()}; draft vocabulary {draft.head.size} of {dec.lm_head.shape[0]}")
    ids = rt.encode("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    from subspec.sampling import SamplingParams, TokenChooser

    eng.prefill(ids, TokenChooser(SamplingParams(), dec.device))
    L0, k = eng.cache_len, args.topk
    tokens = torch.tensor(ids[-k:] * (128 // k + 1), dtype=torch.long)
    idx = torch.arange(eng.kv.max_slots)
    step_attn = Attention.tree(L0, torch.ones(k, k, dtype=torch.bool).tril())

    def draft_step():
        dec.forward(tokens[:k], idx[L0:L0 + k], idx[L0:L0 + k], step_attn, draft.layers, eng.kv, head=draft.head)
        draft._expand(torch.zeros(k, draft.head.size), torch.zeros(k), k)

    wall, groups = profile(draft_step, args.steps)
    accounted = sum(groups.values())
    print(f"\ndraft step ({k} rows): {1e3 * wall:.2f} ms")
    for g, s in sorted(groups.items(), key=lambda x: -x[1]):
        print(f"  {g:28s} {1e3 * s:8.2f} ms")
    print(f"  {'python / dispatch overhead':28s} {1e3 * max(0.0, wall - accounted):8.2f} ms")
    es = dec.lm_head.element_size()
    pl = rt.placement  # the draft reads the substitutes it runs, and the resident layers it has none for
    sub_bytes = len(pl.substituted) * pl.substitute_layer_bytes
    res_bytes = len([i for i in pl.resident if i not in pl.substituted]) * pl.layer_bytes
    head4 = sum(b for n, b, _ in pl.items if n == "draft head")  # a 4-bit copy of the subset, else lm_head rows
    head_bytes = head4 or draft.head.size * dec.lm_head.shape[1] * es
    bw = ram_read_rate()
    floor = (sub_bytes + res_bytes + head_bytes) / bw
    print(f"  weights read: substitutes {fmt_bytes(sub_bytes)} + resident {fmt_bytes(res_bytes)} + draft head "
          f"{fmt_bytes(head_bytes)}; RAM read {bw / 1e9:.1f} GB/s -> floor {1e3 * floor:.2f} ms "
          f"(step / floor = {wall / floor:.2f})")
    for n in (1, 16, 32, 128):
        a = Attention.tree(L0, torch.ones(n, n, dtype=torch.bool).tril())
        w0 = rt.tier.wait_seconds if rt.tier else 0.0

        def verify():
            dec.forward(tokens[:n], idx[L0:L0 + n], idx[L0:L0 + n], a, eng.layers, eng.kv)

        wall, groups = profile(verify, max(2, args.steps // 5))
        waited = ((rt.tier.wait_seconds - w0) / (1 + 2 * max(2, args.steps // 5))) if rt.tier else 0.0
        print(f"\nverify forward ({n} nodes): {1e3 * wall:.1f} ms, of which waiting for weights ~{1e3 * waited:.1f} ms")
        for g, s in sorted(groups.items(), key=lambda x: -x[1]):
            print(f"  {g:28s} {1e3 * s:8.2f} ms")
    rt.close()


if __name__ == "__main__":
    main()
