"""Benchmark outputs: a markdown table and PNG plots (matplotlib, optional ``bench`` extra)."""
from __future__ import annotations

from pathlib import Path


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _mib(x, spec):
    return "-" if not x else f"{x / 2**20:{spec}} MiB"


def _budget(n) -> str:
    """The device-memory budget as a size (bytes -> MiB/GiB), or 'none' when the run had none."""
    from ..placement import fmt_bytes

    return fmt_bytes(n) if n else "none"


def write_table(summary: dict, path: Path) -> str:
    """Write (and return) the per-method markdown table."""
    lines = [f"model `{summary['model']}`, {summary['dtype']}, budget {_budget(summary['device_memory'])}, "
             f"{summary['max_new_tokens']} new tokens" + (f" (ar/hf timed on {summary['flat_tokens']})" if summary.get('flat_tokens') else ""),
             "", summary["tau_definition"], "",
             "equal to ar: prompts whose output is token-identical to ar's over their common length (ar's first "
             f"{summary.get('flat_tokens') or summary['max_new_tokens']} tokens); match rate: median fraction of "
             "equal tokens at equal positions; peak RSS: the method's own process, largest over its prompts", "",
             "| method | tokens/s | speedup vs ar | tau | equal to ar | match rate | bytes/forward | peak RSS (own process) | configuration |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in summary["methods"].items():
        lines.append(f"| {name} | {_fmt(m['tokens_per_second'])} | {_fmt(m['speedup_vs_ar'])}x | {_fmt(m['tau'])} | "
                     f"{m['equal_to_ar']}/{m['prompts']} | {_fmt(m['match_rate'], '.3f')} | "
                     f"{_mib(m['bytes_per_forward'], '.1f')} | {_mib(m['peak_rss'], '.0f')} | {m['info']} |")
    for name, why in summary.get("skipped", {}).items():
        lines.append(f"| {name} | skipped | | | | | | | {why} |")
    timed = {n: m["timeline"] for n, m in summary["methods"].items() if m.get("timeline")}
    if timed:
        lines += ["", "a mean round (ms): the draft (its steps, their mean width) and the disk busy meanwhile "
                  "(read-ahead, overlapped); the verify, its compute and its time blocked on the offload tier, and the "
                  "disk busy meanwhile", "", "| method | rounds | draft | draft steps | width | disk busy while drafting "
                  "| verify | verify compute | verify blocked | disk busy while verifying | round |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for n, t in timed.items():
            ms = {k: 1e3 * v for k, v in t.items() if k.endswith("_seconds")}
            width = "" if t.get("width") is None else f"{t['width']:.1f}"
            lines.append(f"| {n} | {t['rounds']} | {ms['draft_seconds']:.1f} | {t['steps']:.1f} | {width} | "
                         f"{ms['draft_disk_seconds']:.1f} | {ms['verify_seconds']:.1f} | "
                         f"{ms['verify_compute_seconds']:.1f} | {ms['verify_wait_seconds']:.1f} | "
                         f"{ms['verify_disk_seconds']:.1f} | {ms['draft_seconds'] + ms['verify_seconds']:.1f} |")
    if summary.get("wrap"):
        lines += ["", f"every method ran in its own process under `{' '.join(summary['wrap'])}`"]
    sw = summary.get("sweeps", {})
    for kind in ("bits", "depth", "draft_vocab"):
        if sw.get(kind):
            lines += ["", f"| {kind} | tau | tokens/s |", "|---|---|---|"]
            lines += [f"| {k} | {v['tau']:.2f} | {_fmt(v['tokens_per_second'])} |" for k, v in sw[kind].items()]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def write_plots(rows: list[dict], summary: dict, out: Path) -> list[Path]:
    """PNG plots: tokens/s per method, speedup per category, accepted-length histogram, acceptance by depth,
    tau vs bits and tau / tokens/s vs depth (when swept). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    ms = summary["methods"]

    def save(fig, name):
        p = out / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        files.append(p)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(ms)
    ax.bar(names, [ms[n]["tokens_per_second"] or 0 for n in names], color="tab:blue")
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("decode speed at the same memory budget")
    save(fig, "tokens_per_second.png")

    cats = sorted({c for m in ms.values() for c in m["speedup_by_category"]})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    others = [n for n in names if n != "ar"]
    w = 0.8 / max(len(others), 1)
    for j, n in enumerate(others):
        ax.bar([i + j * w for i in range(len(cats))], [ms[n]["speedup_by_category"].get(c) or 0 for c in cats], w, label=n)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + w * (len(others) - 1) / 2 for i in range(len(cats))], cats)
    ax.set_ylabel("speedup vs ar")
    ax.legend(fontsize=8)
    save(fig, "speedup_by_category.png")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for n in others:
        h = ms[n]["accept_length_hist"]
        if sum(h) and len(h) > 1:  # methods that draft (draft-only never does)
            a1.plot(range(len(h)), [x / sum(h) for x in h], marker=".", label=n)
            surv = [sum(h[d:]) / sum(h) for d in range(len(h))]
            a2.plot(range(len(h)), surv, label=n)
    a1.set_xlabel("accepted draft tokens per round")
    a1.set_ylabel("fraction of rounds")
    a2.set_xlabel("tree depth d")
    a2.set_ylabel("P(accepted length >= d)")
    a1.legend(fontsize=8)
    save(fig, "acceptance.png")

    sw = summary.get("sweeps", {})
    if sw.get("bits"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ks = list(sw["bits"])
        ax.plot([("self" if k == "16" else k) for k in ks], [sw["bits"][k]["tau"] for k in ks], marker="o")
        ax.set_xlabel("substitute bits")
        ax.set_ylabel("tau")
        save(fig, "tau_vs_bits.png")
    if sw.get("depth"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ks = list(sw["depth"])
        ax.plot([int(k) for k in ks], [sw["depth"][k]["tau"] for k in ks], marker="o", label="tau")
        ax2 = ax.twinx()
        ax2.plot([int(k) for k in ks], [sw["depth"][k]["tokens_per_second"] for k in ks], marker="s", color="tab:red")
        ax.set_xlabel("draft depth")
        ax.set_ylabel("tau")
        ax2.set_ylabel("tokens/s", color="tab:red")
        save(fig, "depth_sweep.png")
    return files
