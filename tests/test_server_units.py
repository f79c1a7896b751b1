"""The server's parts without a model: stop strings over streamed text, and the engine worker's FIFO queue, bound,
cancellation per round and recovery from a failing request (on a scripted stand-in for the runtime)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs its extra: pip install -e '.[serve]'")

from subspec.engine import GenerationStats  # noqa: E402
from subspec.sampling import SamplingParams  # noqa: E402
from subspec.server.jobs import EngineWorker, Failed, Finished, Job, Round  # noqa: E402
from subspec.server.schema import ApiError  # noqa: E402
from subspec.server.stops import StopMatcher  # noqa: E402


# ---- stop strings ------------------------------------------------------------------------------------------
def test_stop_matcher_holds_back_and_cuts():
    m = StopMatcher(["</end>", "STOP"])
    assert m.feed("Hello </e") == ("Hello ", False)  # '</e' may start a stop string: held back
    assert m.feed("xtra") == ("</extra", False)  # it did not
    assert m.feed(" and ST") == (" and ", False)
    assert m.feed("OP here") == ("", True)  # the stop string and what follows are never shown
    m = StopMatcher(["\n\n"])
    assert m.feed("a\n") == ("a", False)
    assert m.flush() == "\n"  # the answer ended: what was held back is released
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)


# ---- the engine worker on a scripted runtime ---------------------------------------------------------------
class _Engine:
    eos = {0}

    def __init__(self):
        self.last_stats = GenerationStats()
        self.resets = 0

    def reset(self):
        self.resets += 1


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids if i)


class _Runtime:
    """stream_text yields the chunks scripted for a context's first token, one per round; a round waits for
    ``gate`` when set; context [99] raises inside the stream (a bug)."""

    def __init__(self, script: dict[int, list[list[int]]]):
        self.engine, self.tokenizer, self.script = _Engine(), _Tokenizer(), script
        self.started: list[int] = []
        self.rounds_run = 0
        self.gate: threading.Event | None = None

    def stream_text(self, ids, params):
        self.started.append(ids[0])
        return self._gen(ids)

    def _gen(self, ids):
        st = self.engine.last_stats = GenerationStats()
        out: list[int] = []
        if ids[0] == 99:
            raise RuntimeError("scripted failure")
        for chunk in self.script[ids[0]]:
            if self.gate is not None:
                assert self.gate.wait(10)
            self.rounds_run += 1
            st.target_forwards += 1
            st.new_tokens += len(chunk)
            st.wall_seconds += 0.01
            before = self.tokenizer.decode(out)
            out += chunk
            yield chunk, self.tokenizer.decode(out)[len(before):]


def _drain(job: Job, loop, timeout: float = 10) -> list:
    async def collect():
        events = []
        while True:
            ev = await asyncio.wait_for(job.events.get(), timeout)
            events.append(ev)
            if isinstance(ev, (Finished, Failed)):
                return events
    return loop.run_until_complete(collect())


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def test_worker_runs_fifo_and_reports_rounds(loop):
    rt = _Runtime({1: [[1], [2, 3], [4, 0]], 2: [[5], [6]], 3: [[7]]})
    w = EngineWorker(rt, max_queue=4)
    try:
        jobs = [Job([k], SamplingParams(max_new_tokens=8), [], loop) for k in (1, 2, 3)]
        for j in jobs:
            w.submit(j)
        results = [_drain(j, loop) for j in jobs]
    finally:
        w.close()
    assert rt.started == [1, 2, 3]
    first = results[0]
    assert [(e.index, e.tokens, e.text) for e in first[:-1]] == [(0, 1, "b"), (1, 2, "cd"), (2, 2, "e")]
    assert first[-1].finish_reason == "stop" and first[-1].completion_tokens == 5  # EOS (0) ends it
    assert results[1][-1].finish_reason == "length" and results[1][-1].stats["target_forwards"] == 2


def test_queue_bound_cancel_and_recovery(loop):
    rt = _Runtime({1: [[1]] * 50, 2: [[2]], 3: [[3]], 4: [[4], [5]]})
    rt.gate = threading.Event()
    w = EngineWorker(rt, max_queue=2)
    try:
        running = Job([1], SamplingParams(max_new_tokens=50), [], loop)
        w.submit(running)
        t0 = time.monotonic()
        while w.running is None:
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)
        waiting = [Job([k], SamplingParams(max_new_tokens=8), [], loop) for k in (2, 3)]
        for j in waiting:
            w.submit(j)
        with pytest.raises(ApiError) as e:  # the queue is full
            w.submit(Job([4], SamplingParams(max_new_tokens=8), [], loop))
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
        waiting[0].cancel()  # its client left while it waited: it never runs
        running.cancel()  # stops at the end of the round in flight
        rt.gate.set()
        events = _drain(running, loop)
        assert events[-1].finish_reason == "cancelled" and rt.rounds_run <= 2
        assert _drain(waiting[0], loop)[-1].finish_reason == "cancelled"
        assert _drain(waiting[1], loop)[-1].completion_tokens == 1
        assert rt.started == [1, 3]
        broken = Job([99], SamplingParams(max_new_tokens=8), [], loop)  # a failing request ...
        w.submit(broken)
        err = _drain(broken, loop)[-1]
        assert isinstance(err, Failed) and err.error.status == 500 and "scripted failure" in err.error.message
        after = Job([4], SamplingParams(max_new_tokens=8), [], loop)  # ... and the worker goes on
        w.submit(after)
        assert [ev.text for ev in _drain(after, loop) if isinstance(ev, Round)] == ["e", "f"]
        assert rt.engine.resets == 1
    finally:
        w.close()
    with pytest.raises(ApiError) as e:
        w.submit(Job([2], SamplingParams(max_new_tokens=8), [], loop))
    assert e.value.status == 503


def test_stop_string_counts_tokens_up_to_it(loop):
    rt = _Runtime({1: [[1, 2], [3, 4, 5], [6, 7]]})  # text b c | d e f | g h
    w = EngineWorker(rt, max_queue=1)
    try:
        job = Job([1], SamplingParams(max_new_tokens=8), ["de"], loop)
        w.submit(job)
        events = _drain(job, loop)
    finally:
        w.close()
    assert "".join(e.text for e in events if isinstance(e, Round)) == "bc"
    done = events[-1]
    assert done.finish_reason == "stop" and done.completion_tokens == 4  # b, c, d, e: 'de' completes at e
    assert rt.rounds_run == 2
