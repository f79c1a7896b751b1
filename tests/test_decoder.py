"""Our decoder against transformers (FP32): tree attention (with a sliding window), commit, SmolLM2 logits.

Every family's logits and generation against transformers: test_families.py."""
from __future__ import annotations

import pytest
import torch

from subspec.loading import open_model
from subspec.model import Attention, Decoder, ResidentLayers, load_linears
from subspec.tree import DraftTree

from conftest import save_tiny, tiny_config


def build(path):
    src = open_model(path)
    dec = Decoder.from_source(src, torch.float32, "cpu")
    layers = ResidentLayers({i: load_linears(src, i, torch.float32, "cpu") for i in range(dec.n_layers)})
    return src, dec, layers


def hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


ONE = torch.ones(1, 1, dtype=torch.bool)


def linear_logits(dec, layers, ids, kv=None, start=0):
    """Feed ids one token at a time from slot ``start``; logits [T, V]."""
    kv = kv or dec.new_kv_cache(64)
    out = []
    for j, t in enumerate(ids):
        p = torch.tensor([start + j])
        out.append(dec.forward(torch.tensor([t]), p, p, Attention.tree(start + j, ONE), layers, kv))
    return torch.cat(out), kv


@pytest.mark.parametrize("model_type,extra", [("qwen2", {}), ("gemma3_text", dict(
    head_dim=16, sliding_window=3, sliding_window_pattern=2, layers=4))], ids=["qwen2", "gemma3-window3"])
def test_tree_forward_equals_transformers_branches(tmp_path, model_type, extra):
    """Hand-drawn tree: root r -> {a, b}; a -> c (depths 1-2), fed in one forward with the tree mask, equals
    transformers on each branch; with a 3-token window each node sees the window of its own position."""
    path = save_tiny(tmp_path / "m", tiny_config(model_type, False, **extra))
    _, dec, layers = build(path)
    prefix = [5, 17, 3, 99, 42, 8, 64]
    r, a, b, c = 42, 8, 64, 120
    kv = dec.new_kv_cache(32)
    P = len(prefix)
    pos = torch.arange(P)
    dec.forward(torch.tensor(prefix), pos, pos, Attention.run(0), layers, kv)
    tree = DraftTree(tokens=torch.tensor([r, a, b, c]), parents=torch.tensor([0, 0, 0, 1]),
                     depths=torch.tensor([0, 1, 1, 2]),
                     ancestors=torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool))
    slots = P + torch.arange(4)
    tree_logits = dec.forward(tree.tokens, P + tree.depths, slots, Attention.tree(P, tree.ancestors), layers, kv)
    branch_ac = hf_logits(path, prefix + [r, a, c])
    branch_b = hf_logits(path, prefix + [r, b])
    assert (tree_logits[0] - branch_ac[P]).abs().max() <= 1e-4
    assert (tree_logits[1] - branch_ac[P + 1]).abs().max() <= 1e-4
    assert (tree_logits[3] - branch_ac[P + 2]).abs().max() <= 1e-4
    assert (tree_logits[2] - branch_b[P + 1]).abs().max() <= 1e-4
    # a wrong mask (c attending to its uncle b) changes c's logits: the mask really matters
    bad = tree.ancestors.clone()
    bad[3, 2] = True
    bad_logits = dec.forward(tree.tokens, P + tree.depths, slots, Attention.tree(P, bad), layers, kv)
    assert (bad_logits[3] - branch_ac[P + 2]).abs().max() > 1e-3


def test_commit_then_next_step_equals_linear(tmp_path):
    """After committing path r -> a -> c in place, the next token's logits equal linear decoding of that path."""
    path = save_tiny(tmp_path / "m", tiny_config("llama", True))
    _, dec, layers = build(path)
    prefix = [5, 17, 3, 99]
    r, a, b, c, nxt = 42, 8, 64, 120, 77
    P = len(prefix)
    kv = dec.new_kv_cache(32)
    pos = torch.arange(P)
    dec.forward(torch.tensor(prefix), pos, pos, Attention.run(0), layers, kv)
    # node order: r, b, a, c (the accepted nodes are not contiguous)
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    depths = torch.tensor([0, 1, 1, 2])
    dec.forward(torch.tensor([r, b, a, c]), P + depths, P + torch.arange(4), Attention.tree(P, anc), layers, kv)
    kv.buf[:, :, :, P + 4:] = float("nan")  # nothing beyond the committed path may be read
    kv.commit(torch.tensor([P + 2, P + 3]), P + 1)
    L = P + 3
    p = torch.tensor([L])
    after = dec.forward(torch.tensor([nxt]), p, p, Attention.tree(L, ONE), layers, kv)
    ref, _ = linear_logits(dec, layers, prefix + [r, a, c, nxt])
    assert (after[0] - ref[-1]).abs().max() <= 1e-4


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_dir):
    src, dec, layers = build(smollm2_dir)
    tok = src.tokenizer()
    ids = tok("The capital of France is Paris, and the capital of Germany is")["input_ids"]
    ref = hf_logits(smollm2_dir, ids)
    kv = dec.new_kv_cache(64)
    pos = torch.arange(len(ids))
    ours = dec.forward(torch.tensor(ids), pos, pos, Attention.run(0), layers, kv)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_native_tree_attention_sees_the_window_of_the_torch_path(tmp_path):
    """BF16: a tree after a prefix longer than the window, through the native tree-attention kernel and through
    torch's SDPA with our window mask, gives the same logits up to BF16 rounding; without the window it would not."""
    from subspec import kernels

    if not kernels.native():
        pytest.skip(f"native kernels unavailable: {kernels.status()}")
    path = save_tiny(tmp_path / "m", tiny_config("gemma3_text", True, head_dim=16, sliding_window=3,
                                                 sliding_window_pattern=2, layers=4))
    src = open_model(path)
    dec = Decoder.from_source(src, torch.bfloat16, "cpu")
    layers = ResidentLayers({i: load_linears(src, i, torch.bfloat16, "cpu") for i in range(dec.n_layers)})
    assert dec.native_attention and 3 in dec.windows
    prefix = [5, 17, 3, 99, 42, 8, 64, 9, 33]
    P = len(prefix)
    kv = dec.new_kv_cache(32)
    pos = torch.arange(P)
    dec.forward(torch.tensor(prefix), pos, pos, Attention.run(0), layers, kv)
    anc = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
                       dtype=torch.bool)
    tokens, depths, slots = torch.tensor([42, 8, 64, 120, 7]), torch.tensor([0, 1, 1, 2, 3]), P + torch.arange(5)

    def tree_logits():
        return dec.forward(tokens, P + depths, slots, Attention.tree(P, anc), layers, kv).float()

    native = tree_logits()
    dec.native_attention = False
    torch_path = tree_logits()
    windows, dec.windows = dec.windows, [0] * dec.n_layers
    unwindowed = tree_logits()
    dec.windows = windows
    err, off = (native - torch_path).abs().max().item(), (native - unwindowed).abs().max().item()
    assert err <= 0.1 * off, (err, off)
