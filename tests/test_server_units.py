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


# ---- tokenization off the event loop -----------------------------------------------------------------------
class _SlowTokenizer:
    """A stand-in for a fast tokenizer: encoding takes ``seconds`` (the GIL released, as HF tokenizers do); every
    use records its thread and whether another thread was inside the same object at that moment (HF tokenizers then
    fail with "Already borrowed"). Copies share the record."""

    chat_template = "{{ messages }}"

    def __init__(self, log: list, seconds: float):
        self.log, self.seconds, self._inside = log, seconds, 0
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return _SlowTokenizer(self.log, self.seconds)

    def _use(self, what: str, seconds: float):
        with self._lock:
            self._inside += 1
            clash = self._inside > 1
        self.log.append((what, threading.get_ident(), clash))
        time.sleep(seconds)
        with self._lock:
            self._inside -= 1

    def __call__(self, text):
        self._use("encode", self.seconds)
        return {"input_ids": [1 + len(text) % 5] * 8}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        self._use("encode", self.seconds)
        return [2] * 8

    def decode(self, ids, skip_special_tokens=True):
        self._use("decode", 0.002)
        return "".join(chr(ord("a") + i % 26) for i in ids if i)


class _Placement:
    def summary(self):
        return "scripted"


def _serve(app):
    """Run ``app`` with uvicorn on a free 127.0.0.1 port in a thread; returns (base url, server, thread)."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    t0 = time.monotonic()
    while not server.started:
        assert time.monotonic() - t0 < 30, "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, t


def test_long_prompts_are_encoded_off_the_event_loop_one_thread_per_tokenizer():
    """Four clients send long prompts at once while a fifth polls /health: the health answers stay fast (no encoding
    blocks the event loop), no tokenizer object is ever used by two threads at once, none on the event loop's thread,
    and every request completes."""
    import json
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from subspec.server.app import ServerSettings, create_app

    log: list = []
    rt = _Runtime({k: [[k], [k + 1, 0]] for k in range(1, 7)})
    rt.tokenizer = _SlowTokenizer(log, seconds=1.0)
    rt.engine.max_context = 512
    rt.placement = _Placement()
    app = create_app(rt, ServerSettings(model_name="scripted", defaults=SamplingParams(max_new_tokens=4)))
    loop_thread: dict = {}

    @app.get("/loop-thread")
    async def where():
        loop_thread["ident"] = threading.get_ident()
        return {}

    url, server, t = _serve(app)
    try:
        urllib.request.urlopen(url + "/loop-thread", timeout=30).read()

        def post(i: int):
            path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 20000}]})
                          if i % 2 else ("/v1/completions", {"prompt": "y" * (20000 + i)}))
            req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())

        def health_latencies() -> list[float]:
            out = []
            t_end = time.monotonic() + 3.0
            while time.monotonic() < t_end:
                t1 = time.monotonic()
                urllib.request.urlopen(url + "/health", timeout=30).read()
                out.append(time.monotonic() - t1)
                time.sleep(0.05)
            return out

        with ThreadPoolExecutor(5) as pool:
            posts = [pool.submit(post, i) for i in range(4)]
            time.sleep(0.1)
            latencies = pool.submit(health_latencies).result(timeout=60)
            results = [p.result(timeout=60) for p in posts]
    finally:
        server.should_exit = True
        t.join(30)
    assert all(status == 200 for status, _ in results), results
    assert all(body["usage"]["prompt_tokens"] == 8 for _, body in results), results
    encodes = [(ident, clash) for what, ident, clash in log if what == "encode"]
    assert len(encodes) == 4
    assert not any(clash for _, ident, clash in log), log  # never two threads inside one tokenizer
    assert loop_thread["ident"] not in {ident for ident, _ in encodes}  # never on the event loop
    assert max(latencies) < 0.5, latencies  # /health answered while the prompts (1 s each) were encoded


def test_a_request_check_across_fields_names_its_field_as_param():
    """The request model's own checks (n, penalties, logprobs ...) carry no location from pydantic: the error's
    param is the field its message names (OpenAI's clients show it), and the message is kept whole."""
    from pydantic import ValidationError

    from subspec.server.schema import ChatRequest, validation_error

    with pytest.raises(ValidationError) as e:
        ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "n": 2})
    err = validation_error(e.value.errors())
    assert err.param == "n" and err.message == "n: only n = 1 is supported", err.body()
    for msg in ("Value error, the request is odd", "Value error, colour: not a field"):
        assert validation_error([{"loc": ("body",), "msg": msg, "type": "value_error"}]).param is None
