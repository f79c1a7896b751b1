"""The one decode loop: prefill, then rounds of (draft tree -> verify -> commit -> emit).

Every method is this loop with a different :class:`Proposer`: plain decoding ("ar") proposes a root-only tree,
SubSpec proposes a deep tree from the substitute draft, n-gram lookup proposes a chain. Verification is always
one target forward over the tree followed by :func:`subspec.tree.accept` with the target's own choices, so every
method emits exactly the target's tokens.

Acceptance length **tau** = new tokens / target forwards, the prefill counted as the forward that emits the
first token; plain decoding has tau = 1.

The engine holds one conversation (batch 1): :attr:`Engine.tokens`, every token it has been given or has emitted,
of which the first :attr:`Engine.cache_len` have their K/V in the cache (the rest, usually only the last emitted
token, are :attr:`Engine.pending` and are processed first by the next request). A request either appends to the
conversation (:meth:`Engine.stream`) or names the whole context it wants to continue (:meth:`Engine.stream_context`:
prefix reuse, only the tokens the engine does not already hold are prefilled). The stream yields once per round;
closing it between rounds (a cancelled request) leaves the engine holding exactly the tokens it emitted.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional, Protocol

import torch

from .errors import SubspecError
from .kvcache import KVCache
from .model import Attention, Decoder, LayerSource
from .placement import PREFILL_CHUNK, VERIFY_LOGIT_ROWS
from .sampling import SamplingParams, TokenChooser
from .tree import DraftTree, accept


class Proposer(Protocol):
    """Proposes the draft tree of a round.

    ``max_nodes`` bounds the tree size (root included) so the KV cache can reserve scratch slots.
    ``propose(root [1] int64, cache_len)`` returns a :class:`DraftTree` whose node 0 is ``root``; it may write K/V
    at scratch slots ``cache_len ..`` of the shared cache but never below ``cache_len``.
    ``committed(tokens, cut=False)`` is told every token of the conversation once, in order: each prompt, then each
    round's emitted tokens (for proposers that keep their own history); ``cut``: the round's tokens were cut at an EOS
    or the token limit (its accepted run went on past them; no bonus token among them). ``reset()`` forgets the
    conversation; when the engine cuts its conversation back (prefix reuse, an error inside a round) it calls
    ``reset()`` and then ``committed()`` once with the tokens it keeps.
    """

    max_nodes: int

    def propose(self, root: torch.Tensor, cache_len: int) -> DraftTree: ...

    def committed(self, tokens: list[int], cut: bool = False) -> None: ...

    def reset(self) -> None: ...


class NoDraft:
    """Plain autoregressive decoding ("ar"): the tree is the root alone, so each round emits one token."""

    max_nodes = 1

    def propose(self, root: torch.Tensor, cache_len: int) -> DraftTree:
        return DraftTree.chain(root)

    def committed(self, tokens: list[int], cut: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass


TIMELINE = ("draft_seconds", "draft_disk_seconds", "verify_seconds", "verify_wait_seconds", "verify_disk_seconds")
"""The fields of :class:`GenerationStats` that time a request's drafting rounds (summed over its rounds)."""


@dataclass
class GenerationStats:
    """Per-request statistics (times in seconds, sizes in bytes).

    tau = new_tokens / target_forwards (the prefill counted as one); ``accepted_tokens`` / ``accept_lengths``: draft
    tokens emitted (in total / per round), so tokens cut after an EOS or the limit are not counted;
    mean_accepted = accepted draft tokens per round. draft_steps / ``draft_depths``: draft forwards (in total / per
    round: a tree of depth D takes D, a round without a draft 0); ``draft_widths``: each round's frontier width (the
    proposer's ``last_width``; 0 without a draft or for a proposer without one). The per-round lists belong to one
    request (a new :class:`GenerationStats` per request), so a long-running server keeps no growing history;
    draft_misses: rounds whose accepted run stopped before the drafted depth, a round cut by an EOS or the token
    limit not counted (with ``accepted_tokens``, the acceptance estimate of
    :class:`~subspec.speculation.AdaptiveDepth`).
    prefill_tokens: tokens the prefill forward processed; cached_tokens: tokens of the conversation whose K/V were
    already in the cache (prefix reuse: not processed again).
    The rounds' timeline (seconds summed over rounds; an offload tier's disk counters, 0 without one):
    ``draft_seconds`` (the proposer), ``verify_seconds`` (the target's tree forward, accepting and committing),
    ``verify_wait_seconds`` (of the verify, blocked on the offload tier), ``draft_disk_seconds`` /
    ``verify_disk_seconds`` (the disk reading for the tier while the draft / the verify ran: a disk busy while the
    draft runs is read-ahead, overlapped; the verify's compute is ``verify_seconds - verify_wait_seconds``).
    """

    new_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    target_forwards: int = 0
    rounds: int = 0
    draft_steps: int = 0
    draft_misses: int = 0
    accepted_tokens: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    verify_wait_seconds: float = 0.0
    draft_disk_seconds: float = 0.0
    verify_disk_seconds: float = 0.0
    wait_seconds: float = 0.0
    bytes_streamed: int = 0
    wall_seconds: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    draft_depths: list[int] = field(default_factory=list)
    draft_widths: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def mean_width(self) -> Optional[float]:
        """The mean frontier width of the rounds that drafted (None: none did, or none recorded one)."""
        widths = [w for w in self.draft_widths if w]
        return sum(widths) / len(widths) if widths else None

    @property
    def mean_accepted(self) -> float:
        return self.accepted_tokens / max(self.rounds, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, over the time after the prefill."""
        t = self.wall_seconds - self.prefill_seconds
        return (self.new_tokens - 1) / t if t > 0 and self.new_tokens > 1 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, mean_accepted=self.mean_accepted, tokens_per_second=self.tokens_per_second,
                 decode_tokens_per_second=self.decode_tokens_per_second)
        return d


class Engine:
    """Runs generation requests on one model, one conversation at a time (batch 1).

    Args:
        decoder: the model's shared parts and math.
        layers: the target's layer source (resident layers + offload tier).
        proposer: the draft strategy.
        eos_token_ids: tokens that end generation (emitted, then nothing after them).
        max_context: the most tokens a conversation may hold (prompt + generated).
        tier: the offload tier, read for its ``bytes_streamed`` / ``wait_seconds`` counters (None when all resident).
    """

    def __init__(self, decoder: Decoder, layers: LayerSource, proposer: Proposer, eos_token_ids: list[int],
                 max_context: int, tier=None, kv: Optional[KVCache] = None):
        self.decoder, self.layers, self.proposer, self.tier = decoder, layers, proposer, tier
        # the tier's disk busy seconds (DiskTier.busy_seconds), sampled at a round's phase boundaries; 0 without one
        self._disk_busy = getattr(tier, "busy_seconds", None) or (lambda: 0.0)
        self.eos = set(eos_token_ids)
        self.max_context = max_context
        self.kv = kv if kv is not None else decoder.new_kv_cache(max_context + proposer.max_nodes)
        dev = decoder.device
        self._node_idx = torch.arange(self.kv.max_slots, device=dev)
        self.last_stats = GenerationStats()
        self.reset()

    def reset(self) -> None:
        """Forget the conversation: the next request starts from an empty cache."""
        self.tokens: list[int] = []
        self.cache_len = 0
        self.proposer.reset()

    @property
    def pending(self) -> list[int]:
        """Tokens of the conversation whose K/V the cache does not hold yet (the last emitted token, or a prompt
        whose prefill was interrupted): the next request processes them first."""
        return self.tokens[self.cache_len:]

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` tokens of the conversation (their K/V stay valid: slots below ``n`` are never
        rewritten by later tokens); the proposer is told the shorter conversation."""
        if n >= len(self.tokens):
            return
        self.tokens = self.tokens[:n]
        self.cache_len = min(self.cache_len, n)
        self.proposer.reset()
        if n:
            self.proposer.committed(self.tokens)

    def check_room(self, n_context: int, params: SamplingParams) -> None:
        """Raise SubspecError when a context of ``n_context`` tokens + max_new_tokens exceeds the context."""
        if n_context + params.max_new_tokens > self.max_context:
            raise SubspecError(
                f"prompt ({n_context} tokens) + max-new-tokens ({params.max_new_tokens}) exceeds the context of "
                f"{self.max_context} tokens: shorten the prompt, lower --max-new-tokens or raise --max-context")

    # ---- phases ---------------------------------------------------------------------------------------------
    def prefill(self, tokens: list[int], chooser: TokenChooser) -> torch.Tensor:
        """Run the target over ``tokens`` after the committed prefix, in chunks of :data:`PREFILL_CHUNK` tokens (the
        workspace the placement reserves); return the first new token [1]."""
        dev, start, n = self.decoder.device, self.cache_len, len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        for c in range(0, n, PREFILL_CHUNK):
            s, m = start + c, min(PREFILL_CHUNK, n - c)
            pos = self._node_idx[s:s + m]
            rows = slice(m - 1, m) if c + m == n else slice(0, 0)  # logits of the last token only
            logits = self.decoder.forward(ids[c:c + m], pos, pos, Attention.run(s), self.layers, self.kv,
                                          logits_rows=rows)
            self.cache_len = s + m
        return chooser(logits, self.cache_len)  # the token of position cache_len

    def verify(self, tree: DraftTree, chooser: TokenChooser) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the tree at slots ``cache_len + node``; returns (path mask [N], bonus [1])."""
        L0, n = self.cache_len, tree.size
        slots = self._node_idx[L0:L0 + n]
        choice = self.decoder.forward(tree.tokens, L0 + tree.depths, slots, Attention.tree(L0, tree.ancestors),
                                      self.layers, self.kv, head=self.choosing_head(chooser, L0 + 1, tree.depths))
        return accept(tree, choice)  # a node of depth d chose the token of position L0 + 1 + d

    def choosing_head(self, chooser: TokenChooser, first: int, depths: torch.Tensor):
        """The verify forward's output head: final-normed hidden states [N, hidden] -> the chooser's tokens [N] int64.

        The lm_head's logits are made :data:`~subspec.placement.VERIFY_LOGIT_ROWS` rows at a time and chosen from
        (a node of depth d chooses the token of position ``first + d``; depths [N] on the device), so a verify holds
        at most that many rows of logits (the workspace the placement reserves), never [N, vocab]. On a
        batch-invariant kernel tier a row's logits have the same bits in any chunk."""
        n, rows, head = depths.shape[0], VERIFY_LOGIT_ROWS, self.decoder.lm_head_linear
        if n <= rows:
            return lambda h: chooser(head(h), first, depths)
        return lambda h: torch.cat([chooser(head(h[r:r + rows]), first, depths[r:r + rows], span=n)
                                    for r in range(0, n, rows)])

    def commit(self, path_nodes: torch.Tensor) -> None:
        """Keep the accepted path's K/V: nodes [a+1] (root first) move to slots L0..L0+a; cache_len grows by a+1."""
        L0 = self.cache_len
        self.kv.commit(L0 + path_nodes[1:], L0 + 1)
        self.cache_len = L0 + path_nodes.numel()

    # ---- requests -------------------------------------------------------------------------------------------
    def stream_context(self, context_ids: list[int], params: SamplingParams) -> Iterator[list[int]]:
        """Generate after ``context_ids``, the whole context to continue (e.g. a templated chat history), yielding
        token chunks as accepted (one per round).

        Prefix reuse: the longest prefix of ``context_ids`` that the engine already holds keeps its K/V and is not
        processed again (``last_stats.cached_tokens``); whatever the engine holds beyond it is dropped.

        Raises:
            SubspecError: invalid sampling values, an empty context, or context + max_new_tokens beyond the context
                (checked before the engine changes).
        """
        params.validate()
        self.check_room(len(context_ids), params)
        if not context_ids:
            raise SubspecError("empty prompt: give at least one token of input")
        held, n = self.tokens, 0
        limit = min(len(held), len(context_ids))
        while n < limit and held[n] == context_ids[n]:
            n += 1
        self.truncate(n)
        return self.stream(context_ids[n:], params)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[list[int]]:
        """Generate after ``prompt_ids`` (appended to the conversation), yielding token chunks as accepted (one per
        round; the first is the prefill's token).

        Statistics of the request are in :attr:`last_stats` when the iterator ends. Closing the iterator (between
        rounds) stops generation at once; the conversation then holds the prompt and the tokens yielded so far.

        Raises:
            SubspecError: invalid sampling values, or prompt + max_new_tokens beyond the context.
        """
        params.validate()
        if not self.tokens and not prompt_ids:
            raise SubspecError("empty prompt: give at least one token of input")
        self.check_room(len(self.tokens) + len(prompt_ids), params)
        return self._stream(list(prompt_ids), params)

    def _stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[list[int]]:
        st = self.last_stats = GenerationStats()
        chooser = TokenChooser(params, self.decoder.device)
        bytes0, wait0 = self.tier_counters()
        t_start = time.perf_counter()
        self.tokens += prompt_ids
        if self.cache_len == len(self.tokens):  # all of it cached: the last token runs again for its logits
            self.cache_len -= 1
        try:
            st.cached_tokens = self.cache_len
            st.prefill_tokens = len(self.tokens) - self.cache_len
            root = self.prefill(self.tokens[self.cache_len:], chooser)
            st.target_forwards = 1
            st.prefill_seconds = time.perf_counter() - t_start
            self.proposer.committed(prompt_ids)  # a pending token was already reported last turn
            out, done, _ = self._emit(root.tolist(), st, params)
            yield out
            while not done:
                t0, d0 = time.perf_counter(), self._disk_busy()
                tree = self.proposer.propose(root, self.cache_len)
                t1, d1, w1 = time.perf_counter(), self._disk_busy(), self.tier_counters()[1]
                path, root = self.verify(tree, chooser)
                nodes = torch.nonzero(path)[:, 0]
                self.commit(nodes)
                out = torch.cat((tree.tokens[nodes[1:]], root)).tolist()  # the round's one host sync
                t2, d2 = time.perf_counter(), self._disk_busy()
                st.verify_wait_seconds += self.tier_counters()[1] - w1
                st.draft_disk_seconds += d1 - d0
                st.verify_disk_seconds += d2 - d1
                st.draft_seconds += t1 - t0
                steps = getattr(self.proposer, "last_steps", 0)  # a SubSpec tree of depth D: D draft forwards
                st.draft_steps += steps
                st.verify_seconds += t2 - t1
                st.target_forwards += 1
                st.rounds += 1
                out, done, cut = self._emit(out, st, params)
                accepted = min(len(out), len(nodes) - 1)  # draft tokens emitted (the bonus is not a draft token)
                st.accepted_tokens += accepted
                st.accept_lengths.append(accepted)
                st.draft_depths.append(steps)
                st.draft_widths.append(getattr(self.proposer, "last_width", 0) if steps else 0)
                st.draft_misses += accepted < steps and not cut  # stopped before its depth (not cut short)
                yield out
        except BaseException as e:  # stopped inside a round: the proposer relearns the conversation the engine holds
            if not isinstance(e, GeneratorExit):
                self.proposer.reset()
                self.proposer.committed(self.tokens)
            raise
        finally:
            # a round stopped after its commit is dropped: the cache holds at most the tokens before the last one
            self.cache_len = min(self.cache_len, max(len(self.tokens) - 1, 0))
            st.wall_seconds = time.perf_counter() - t_start
            b, w = self.tier_counters()
            st.bytes_streamed, st.wait_seconds = b - bytes0, w - wait0

    def _emit(self, out: list[int], st: GenerationStats,
              params: SamplingParams) -> tuple[list[int], bool, bool]:
        """Cut a round's tokens (:meth:`_cut`), drop the K/V of the tokens cut, count and report the rest: (the
        tokens kept, whether generation ends, whether any was cut)."""
        full = len(out)
        out, done = self._cut(out, st, params)
        cut = len(out) < full
        self.cache_len -= full - len(out)  # K/V of tokens cut after an EOS / the limit are dropped
        self.tokens += out
        st.new_tokens += len(out)
        self.proposer.committed(out, cut=cut)
        return out, done, cut

    def _cut(self, out: list[int], st: GenerationStats, params: SamplingParams) -> tuple[list[int], bool]:
        """Cut a round's tokens at the first EOS (kept) and at max_new_tokens; say whether generation ends."""
        room = params.max_new_tokens - st.new_tokens
        for i, t in enumerate(out[:room]):
            if t in self.eos:
                return out[:i + 1], True
        if len(out) >= room:
            return out[:room], True
        return out, False

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """Generate and return all new token ids (see :meth:`stream`)."""
        out: list[int] = []
        for chunk in self.stream(prompt_ids, params):
            out.extend(chunk)
        return out

    def tier_counters(self) -> tuple[int, float]:
        """(bytes streamed, seconds blocked) of the offload tier so far (its running counters; zeros when all
        resident)."""
        if self.tier is None:
            return 0, 0.0
        return self.tier.bytes_streamed, self.tier.wait_seconds
