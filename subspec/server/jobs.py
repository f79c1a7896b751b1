"""One engine, batch 1 (design.md §4.1): a worker thread runs requests one at a time from a bounded FIFO queue.

A request is a :class:`Job`. The worker streams it through :meth:`~subspec.runtime.Runtime.stream_text` (prefix
reuse: only the tokens the engine does not already hold are prefilled) and hands the request handler one
:class:`Round` per engine round (the tokens one target forward emitted and their text), then one :class:`Finished`
(or :class:`Failed`). Between rounds it checks the job's cancel flag (set when the client disconnects) and the
stop strings, and closes the engine's stream at once: a cancelled request stops within one round and leaves the
engine holding exactly the tokens it emitted.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ..engine import TIMELINE
from ..errors import SubspecError
from .schema import ApiError
from .stops import StopMatcher

log = logging.getLogger("subspec.server")


@dataclass
class Round:
    """What one engine round emitted: ``tokens`` new tokens (the first round is the prefill's one token) and
    ``text``, the text now safe to show (it may be empty while a character or a possible stop string is
    incomplete)."""

    index: int
    tokens: int
    text: str


@dataclass
class Finished:
    """The end of a request. ``finish_reason``: 'stop' (EOS or a stop string), 'length' (max_tokens) or
    'cancelled'. ``stats``: the ``subspec`` object every response carries (tau, tokens/s, target forwards, bytes
    streamed, prompt tokens prefilled and reused from the cache, seconds of prefill, generation and queueing, and the
    drafting rounds' timeline: rounds, seconds of drafting and of verifying, of the verify blocked on the offload tier,
    and of the disk busy while drafting and while verifying: :class:`~subspec.engine.GenerationStats`)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stats: dict = field(default_factory=dict)


@dataclass
class Failed:
    error: ApiError


Event = Union[Round, Finished, Failed]


class Job:
    """One generation request: context token ids (the whole templated conversation), sampling parameters and
    stop strings. Events go to :attr:`events` (an asyncio queue of the server's event loop)."""

    def __init__(self, ids: list[int], params, stops: list[str], loop: asyncio.AbstractEventLoop):
        self.ids, self.params, self.stops, self.loop = ids, params, stops, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.monotonic()
        self.rounds = self.tokens = 0  # progress so far (rounds = target forwards run, the prefill included)

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening
            pass

    def cancel(self) -> None:
        """Stop this job at the end of the current round (or skip it if it has not started)."""
        self.cancelled.set()


class EngineWorker:
    """The thread that owns the engine. ``max_queue`` bounds the jobs waiting behind the running one; beyond it
    :meth:`submit` raises a 429 :class:`ApiError` with a Retry-After estimate. ``on_finish(job, Finished)`` is
    called on the worker thread after each job (metrics)."""

    def __init__(self, rt, max_queue: int, on_finish: Optional[Callable] = None):
        self.rt, self.max_queue, self.on_finish = rt, max_queue, on_finish
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        self.running: Optional[Job] = None
        self._mean_seconds = 5.0  # running mean of a request's engine time (for Retry-After)
        self._thread = threading.Thread(target=self._loop, name="subspec-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return len(self._queue)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if len(self._queue) >= self.max_queue:
                wait = max(1, round(self._mean_seconds * (len(self._queue) + 1)))
                raise ApiError(429, f"the request queue is full ({self.max_queue} waiting): retry in about {wait} s",
                               code="queue_full", headers={"Retry-After": str(wait)})
            self._queue.append(job)
            self._cv.notify()

    def close(self, timeout: float = 60.0) -> None:
        """Cancel the running job (at its next round boundary) and every waiting one; wait for the thread."""
        with self._cv:
            self._closing = True
            if self.running is not None:
                self.running.cancel()
            self._cv.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self.running = job
            try:
                if self._closing:
                    job.emit(Failed(ApiError(503, "the server is shutting down", code="shutting_down")))
                elif job.cancelled.is_set():  # its client left while it waited
                    job.emit(Finished("cancelled", len(job.ids), 0, 0))
                else:
                    self._run(job)
            except Exception as e:  # noqa: BLE001 - a bug must not stop the worker; the engine starts afresh
                log.exception("generation failed")
                self.rt.engine.reset()
                job.emit(Failed(ApiError(500, f"internal error: {type(e).__name__}: {e}")))
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        rt, t0 = self.rt, time.monotonic()
        stops = StopMatcher(job.stops)
        out: list[int] = []
        counted, hit, r, stream = None, False, 0, None
        try:
            stream = rt.stream_text(job.ids, job.params)
            for r, (chunk, new) in enumerate(stream):
                before = len(out)
                out += chunk
                job.rounds, job.tokens = r + 1, len(out)
                text, hit = stops.feed(new)
                if hit:
                    counted = before + self._tokens_to_stop(out[:before], chunk, stops)
                job.emit(Round(r, (counted or len(out)) - before, text))
                if hit or job.cancelled.is_set():
                    break
            if not hit:
                rest = stops.flush()  # held back as a possible stop string that never completed
                if rest:
                    job.emit(Round(r, 0, rest))
        except SubspecError as e:
            job.emit(Failed(ApiError(400, str(e))))
            return
        finally:
            if stream is not None:
                stream.close()
        st = rt.engine.last_stats
        n = counted if counted is not None else st.new_tokens
        if hit or (out and out[-1] in rt.engine.eos):
            reason = "stop"
        else:
            reason = "cancelled" if job.cancelled.is_set() and n < job.params.max_new_tokens else "length"
        stats = {"tau": n / max(st.target_forwards, 1),
                 "tokens_per_second": n / st.wall_seconds if st.wall_seconds else 0.0,
                 "target_forwards": st.target_forwards, "bytes_streamed": st.bytes_streamed,
                 "prefill_tokens": st.prefill_tokens, "cached_tokens": st.cached_tokens,
                 "prefill_seconds": st.prefill_seconds, "generation_seconds": st.wall_seconds,
                 "queue_seconds": t0 - job.submitted, "rounds": st.rounds,
                 **{k: getattr(st, k) for k in TIMELINE}}
        done = Finished(reason, len(job.ids), n, st.cached_tokens, stats)
        self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.monotonic() - t0)
        if self.on_finish is not None:
            self.on_finish(job, done)
        job.emit(done)

    def _tokens_to_stop(self, before: list[int], chunk: list[int], stops: StopMatcher) -> int:
        """How many of this round's tokens it takes to complete the stop string (the rest is not counted)."""
        for k in range(1, len(chunk)):
            if stops.found_in(self.rt.tokenizer.decode(before + chunk[:k], skip_special_tokens=True)):
                return k
        return len(chunk)
