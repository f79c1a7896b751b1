"""The engine's conversation: prefix reuse (only tokens the engine does not hold are prefilled, counted in the
stats), and a stream closed between rounds or stopped inside a round leaves the engine exact: every later answer
equals a fresh run over the same context."""
from __future__ import annotations

import pytest

from subspec.sampling import SamplingParams
from subspec.speculation import TreeSettings

from conftest import save_tiny, tiny_config
from test_speculation import _tiny_subspec

P = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("conv") / "m", tiny_config("llama", True, vocab=48, layers=3))
    settings = TreeSettings(depth=5, topk=2, verify_budget=10, threshold=0.0)
    _, _, full, _, eng, _ = _tiny_subspec(path, bits=4, settings=settings)
    return eng


def fresh(eng, ctx, params=P) -> list[int]:
    eng.reset()
    return eng.generate(ctx, params)


def run(eng, ctx, params=P) -> list[int]:
    return [t for chunk in eng.stream_context(ctx, params) for t in chunk]


def test_prefix_reuse_prefills_only_new_tokens(engine):
    eng = engine
    A = [5, 6, 7, 8]
    ref_a = fresh(eng, A)
    eng.reset()
    a = run(eng, A)
    assert a == ref_a and eng.last_stats.prefill_tokens == 4 and eng.last_stats.cached_tokens == 0
    assert eng.tokens == A + a and eng.cache_len == len(A + a) - 1  # the last emitted token is pending
    B = A + a + [9, 10]  # the next turn extends the conversation
    b = run(eng, B)
    st = eng.last_stats
    assert st.cached_tokens == len(A + a) - 1 and st.prefill_tokens == 3  # the pending token + 2 new ones
    assert b == fresh(eng, B)
    run(eng, B)
    C = A + [11, 12]  # diverges after A: A's K/V are kept, the rest is dropped
    c = run(eng, C)
    assert eng.last_stats.cached_tokens == 4 and eng.last_stats.prefill_tokens == 2
    assert c == fresh(eng, C)
    run(eng, C)
    again = run(eng, C)  # the same context again: all of it cached, its last token runs again for the logits
    assert eng.last_stats.cached_tokens == len(C) - 1 and eng.last_stats.prefill_tokens == 1
    assert again == c


def test_closed_stream_leaves_exactly_what_was_emitted(engine):
    eng = engine
    D = [3, 4, 5, 6, 7]
    p = SamplingParams(max_new_tokens=30)
    eng.reset()
    gen = eng.stream_context(D, p)
    emitted = next(gen) + next(gen) + next(gen)  # the prefill's token and two rounds
    gen.close()
    assert eng.tokens == D + emitted and eng.cache_len == len(eng.tokens) - 1
    assert emitted == fresh(eng, D, p)[:len(emitted)]
    eng.reset()
    gen = eng.stream_context(D, p)
    emitted = next(gen) + next(gen)
    gen.close()
    E = D + emitted + [13]
    e = run(eng, E)
    assert eng.last_stats.cached_tokens == len(D + emitted) - 1
    assert e == fresh(eng, E)


class _FailingLayers:
    """The target's layers, raising at the ``fail_at``-th acquire (an error inside a forward)."""

    def __init__(self, inner, fail_at: int):
        self.inner, self.left = inner, fail_at

    def acquire(self, i):
        self.left -= 1
        if self.left == 0:
            raise RuntimeError("injected failure")
        return self.inner.acquire(i)

    def release(self, i):
        self.inner.release(i)


@pytest.mark.parametrize("fail_at", [2, 9])  # inside the prefill; inside the verify of the second round
def test_error_inside_a_forward_leaves_the_engine_exact(engine, fail_at):
    eng = engine
    F = [8, 9, 10, 11]
    layers = eng.layers
    eng.reset()
    eng.layers = _FailingLayers(layers, fail_at)
    got: list[int] = []
    try:
        with pytest.raises(RuntimeError, match="injected"):
            for chunk in eng.stream_context(F, P):
                got += chunk
    finally:
        eng.layers = layers
    assert eng.tokens == F + got and eng.cache_len <= len(eng.tokens) - 1
    G = F + got + [14]
    g = run(eng, G)
    assert g == fresh(eng, G)
