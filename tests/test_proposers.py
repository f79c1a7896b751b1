"""Peer proposers (n-gram lookup, a separate draft model) through the same verifier: exact output."""
from __future__ import annotations

import torch

from subspec.draft_model import DraftModel
from subspec.engine import Engine, NoDraft
from subspec.loading import open_model
from subspec.lookup import NgramLookup
from subspec.sampling import SamplingParams
from subspec.speculation import TreeSettings

from conftest import save_tiny, tiny_config
from test_decoder import build


def test_ngram_lookup_finds_latest_continuation():
    p = NgramLookup(length=3, max_ngram=2)
    p.committed([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    assert p.lookup() == [5, 6, 7]  # the latest earlier "2 3" is followed by 5 6 7
    p.reset()
    p.committed([1, 2, 3])
    assert p.lookup() == []


def test_ngram_lookup_hangs_its_chain_under_the_root_it_is_given():
    """Node 0 of the proposed tree is the ``root`` the engine passes (the protocol), not a token of its own history."""
    p = NgramLookup(length=3, max_ngram=2)
    p.committed([1, 2, 3, 4, 9, 2, 3])
    tree = p.propose(torch.tensor([3]), 7)
    assert tree.tokens.tolist() == [3, 4, 9, 2]
    tree = p.propose(torch.tensor([11]), 7)
    assert tree.tokens[0].item() == 11 and tree.size >= 1


def test_ngram_and_draft_model_equal_ar_across_turns(tmp_path):
    path = save_tiny(tmp_path / "t", tiny_config("qwen2", True, vocab=48, layers=3))
    small = save_tiny(tmp_path / "d", tiny_config("qwen2", True, vocab=48, layers=1), seed=1)
    src, dec, layers = build(path)
    ar = Engine(dec, layers, NoDraft(), [], 160)
    settings = TreeSettings(depth=4, topk=2, verify_budget=8, threshold=0.0)
    proposers = [NgramLookup(length=6, device="cpu"),
                 DraftModel(open_model(small), settings, 160 + settings.max_nodes, torch.float32, "cpu")]
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]  # repetitive: lookup has something to propose
    turn2 = [7, 8, 3, 4]
    p = SamplingParams(max_new_tokens=24)
    ref1, ref2 = ar.generate(prompt, p), ar.generate(turn2, p)
    for prop in proposers:
        eng = Engine(dec, layers, prop, [], 160)
        assert eng.generate(prompt, p) == ref1
        assert eng.generate(turn2, p) == ref2  # the second turn continues the conversation
        assert eng.last_stats.target_forwards <= 24
        eng.reset()
        assert eng.generate(prompt, p) == ref1
