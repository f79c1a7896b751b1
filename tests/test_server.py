"""``subspec serve`` as a client sees it: the official openai client, raw HTTP and a real headless Chromium against
one live server on 127.0.0.1 (started once for the module: SmolLM2-135M in float32, 7 of 30 layers offloaded to
disk, a small fixed draft tree). Every loop and wait is bounded."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli_process import run_cli

openai = pytest.importorskip("openai", reason="the server tests use the official openai client: pip install -e '.[test]'")

KEY = "sk-test-subspec"
MAX_QUEUE = 8
MAX_CONTEXT = 384
MODEL_FLAGS = ["--dtype", "float32", "--max-context", str(MAX_CONTEXT), "--depth", "4", "--topk", "2",
               "--verify-budget", "8"]
DEFAULT_MAX_TOKENS = 16
PROMPT = "Write a haiku about the sea."
LONG = "Count from 1 to 300, separated by commas."  # a long answer: a request that keeps the engine busy


@dataclass
class Server:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, timeout=300, **kw)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def health(self) -> dict:
        status, body = self.get("/health")
        assert status == 200, body
        return json.loads(body)

    def metric(self, name: str, **labels) -> float:
        """The value of one Prometheus sample (0 when absent)."""
        _, text = self.get("/metrics")
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([-0-9.e+]+)$", line)
            if m and m.group(1) == name and (m.group(2) or "{}")[1:-1] == want:
                return float(m.group(3))
        return 0.0

    def post(self, path: str, body, key: str | None = KEY) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def wait_idle(self, timeout: float = 120) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            h = self.health()
            if not h["busy"] and h["queue_depth"] == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"the server is still busy after {timeout} s: {self.health()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _budget(model: Path) -> str:
    """A budget keeping 23 of 30 layers resident: a few layers stream from disk, every forward stays short."""
    from subspec.loading import open_model
    from subspec.runtime import Options, plan_for

    opts = Options(model=str(model), dtype="float32", max_context=MAX_CONTEXT, depth=4, topk=2, verify_budget=8)
    full, _ = plan_for(opts, open_model(model))
    return str(full.full_draft_minimum + 24 * full.layer_bytes)


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "subspec", "serve", "--model", str(smollm2_gguf), "--port", str(port),
           "--api-key", KEY, "--max-queue", str(MAX_QUEUE), "--max-new-tokens", str(DEFAULT_MAX_TOKENS),
           "--device-memory", _budget(smollm2_gguf), *MODEL_FLAGS]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    srv = Server(f"http://127.0.0.1:{port}", port, proc, log)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if srv.health()["status"] == "ok":
                    break
            except (OSError, AssertionError):
                pass
            assert time.monotonic() - t0 < 600, f"the server did not start in 600 s:\n{log.read_text()}"
            time.sleep(0.5)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def reference(server) -> dict:
    """Greedy chat answer to PROMPT with the server's default max_tokens, through the openai client."""
    r = server.client().chat.completions.create(model="subspec", messages=[{"role": "user", "content": PROMPT}],
                                                temperature=0)
    return {"text": r.choices[0].message.content, "tokens": r.usage.completion_tokens,
            "finish": r.choices[0].finish_reason}


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="subspec", messages=messages, temperature=0, **kw)


# ---- the openai client -------------------------------------------------------------------------------------
def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    h = server.health()
    assert h["max_context"] == MAX_CONTEXT and "offloaded (disk)" in h["placement"] and h["queue_depth"] == 0


def test_chat_stream_and_not(server, reference):
    r = _chat(server.client(), [{"role": "user", "content": PROMPT}])
    ch = r.choices[0]
    assert ch.message.content == reference["text"] and ch.message.content.strip()
    assert ch.finish_reason in ("stop", "length") and r.usage.completion_tokens <= DEFAULT_MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    s = r.subspec
    assert s["target_forwards"] >= 1 and s["bytes_streamed"] > 0 and s["tokens_per_second"] > 0
    assert s["tau"] == pytest.approx(r.usage.completion_tokens / s["target_forwards"])
    stream = _chat(server.client(), [{"role": "user", "content": PROMPT}], stream=True,
                   stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["text"]
    rounds = [c.subspec for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert [x["round"] for x in rounds] == list(range(len(rounds)))  # one chunk per engine round
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == reference["finish"]
    stats, usage = final[0].subspec, chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == reference["tokens"]
    assert sum(x["tokens"] for x in rounds) == usage.completion_tokens
    assert stats["target_forwards"] == len(rounds) and stats["bytes_streamed"] > 0


def test_completions_stream_and_not(server):
    client = server.client()
    r = client.completions.create(model="subspec", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text.strip() and r.usage.completion_tokens <= 8
    assert r.subspec["target_forwards"] >= 1
    chunks = list(client.completions.create(model="subspec", prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_greedy_equals_subspec_generate(server, reference, smollm2_gguf):
    """The served answer (speculative, 7 layers streamed from disk) equals `subspec generate` (plain decoding, all
    resident) for the same prompt."""
    r = run_cli("generate", PROMPT, "--json", "--method", "ar", "--model", str(smollm2_gguf), "--dtype", "float32",
                "--max-context", str(MAX_CONTEXT), "--max-new-tokens", str(DEFAULT_MAX_TOKENS), timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"] == reference["text"] and len(out["token_ids"]) == reference["tokens"]


def test_stop_strings_and_seed(server, reference):
    client = server.client()
    words = reference["text"].split()
    assert len(words) >= 3, reference
    stop = " " + words[2]
    cut = reference["text"][:reference["text"].index(stop)]
    r = _chat(client, [{"role": "user", "content": PROMPT}], stop=[stop, "never-seen"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < reference["tokens"]
    streamed = _chat(client, [{"role": "user", "content": PROMPT}], stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut
    sampled = [client.chat.completions.create(model="subspec", messages=[{"role": "user", "content": PROMPT}],
                                              temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 40})
               .choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0].strip()


def test_second_chat_turn_prefills_only_its_new_tokens(server):
    client = server.client()
    msgs = [{"role": "user", "content": "Name a fruit."}]
    first = _chat(client, msgs, max_tokens=8)
    held = first.usage.prompt_tokens + first.usage.completion_tokens  # what the engine holds after turn 1
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And a vegetable?"}]
    prefilled0, cached0 = server.metric("subspec_prefill_tokens_total"), server.metric("subspec_cached_tokens_total")
    second = _chat(client, msgs, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # all of turn 1 is reused except its last token, whose K/V no forward has computed yet
    assert cached == held - 1 and second.subspec["cached_tokens"] == cached
    assert second.subspec["prefill_tokens"] == second.usage.prompt_tokens - cached
    assert second.subspec["prefill_tokens"] < 20 < cached
    assert server.metric("subspec_prefill_tokens_total") - prefilled0 == second.subspec["prefill_tokens"]
    assert server.metric("subspec_cached_tokens_total") - cached0 == cached
    alone = _chat(client, [{"role": "user", "content": "And a vegetable?"}], max_tokens=8)  # another conversation
    again = _chat(client, msgs, max_tokens=8)  # the same second turn after it: recomputed, same answer
    assert again.choices[0].message.content == second.choices[0].message.content
    assert again.subspec["prefill_tokens"] > second.subspec["prefill_tokens"]
    assert alone.choices[0].message.content


# ---- one engine, many clients ------------------------------------------------------------------------------
TOPICS = ["the sea", "a cat", "the moon", "bread", "rain", "a robot", "music", "winter"]
FOLLOW_UPS = ["Write one sentence about {}.", "Say it in other words.", "Now make it shorter."]


def _conversation(client, topic: str) -> list[str]:
    msgs, answers = [], []
    for turn in FOLLOW_UPS:
        msgs.append({"role": "user", "content": turn.format(topic)})
        answer = _chat(client, msgs, max_tokens=6).choices[0].message.content
        msgs.append({"role": "assistant", "content": answer})
        answers.append(answer)
    return answers


def test_eight_concurrent_clients_each_equal_their_sequential_result(server):
    """8 clients x 3 chat turns at once: all complete, none lost or mixed, each answer equal to the same
    conversation run alone (greedy); the queue never holds more than 7."""
    client = server.client()
    sequential = [_conversation(client, t) for t in TOPICS]
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        concurrent = list(pool.map(lambda t: _conversation(server.client(), t), TOPICS))
    assert concurrent == sequential
    assert len({a for conv in sequential for a in conv}) > len(TOPICS)  # the answers really differ
    server.wait_idle()


def test_disconnect_mid_stream_cancels_within_one_round(server, reference):
    client = server.client()
    forwards0 = server.metric("subspec_target_forwards_total")
    cancelled0 = server.metric("subspec_finished_requests_total", reason="cancelled")
    tokens0 = server.metric("subspec_generated_tokens_total")
    stream = _chat(client, [{"role": "user", "content": LONG}], max_tokens=300, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    rounds_at_close = server.health()["running"]["rounds"]
    stream.close()
    t0 = time.monotonic()
    while server.metric("subspec_finished_requests_total", reason="cancelled") == cancelled0:
        assert time.monotonic() - t0 < 60, "the cancelled request did not finish"
        time.sleep(0.05)
    forwards = server.metric("subspec_target_forwards_total") - forwards0
    assert forwards <= rounds_at_close + 2  # the round in flight when the disconnect was seen, at most one more
    assert server.metric("subspec_generated_tokens_total") - tokens0 < 300
    server.wait_idle()
    after = _chat(client, [{"role": "user", "content": PROMPT}])  # the engine is consistent for the next request
    assert after.choices[0].message.content == reference["text"]


def test_full_queue_answers_429(server, reference):
    client = server.client(max_retries=0)
    running = _chat(client, [{"role": "user", "content": LONG}], max_tokens=300, stream=True)
    next(iter(running))  # it is running
    waiting = [_chat(client, [{"role": "user", "content": f"{LONG} ({i})"}], max_tokens=300, stream=True)
               for i in range(MAX_QUEUE)]
    try:
        assert server.health()["queue_depth"] == MAX_QUEUE
        with pytest.raises(openai.RateLimitError) as e:
            _chat(client, [{"role": "user", "content": PROMPT}])
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["type"] == "rate_limit_error" and e.value.body["code"] == "queue_full"
    finally:
        for s in [running, *waiting]:
            s.close()
    server.wait_idle()  # the clients left: the waiting requests are dropped, the running one stops
    assert _chat(client, [{"role": "user", "content": PROMPT}]).choices[0].message.content == reference["text"]


# ---- bad requests ------------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
OK_BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("body, key, status, fragment, param", [
    (b'{"messages": [', KEY, 400, "not valid JSON", None),
    (b"not json at all", KEY, 400, "not valid JSON", None),
    (OK_BODY | {"max_tokens": "many"}, KEY, 400, "valid integer", "max_tokens"),
    (OK_BODY | {"temperature": "hot"}, KEY, 400, "valid number", "temperature"),
    (OK_BODY | {"messages": [{"role": "user", "content": 3}]}, KEY, 400, "valid string", "messages.0.content"),
    (OK_BODY | {"colour": "blue"}, KEY, 400, "unknown field 'colour'", "colour"),
    (OK_BODY | {"n": 3}, KEY, 400, "n = 1", "n"),
    (OK_BODY | {"logit_bias": {"1": 2}}, KEY, 400, "logit_bias is not supported", "logit_bias"),
    (OK_BODY | {"max_tokens": 1000}, KEY, 400, "exceeds the context", "max_tokens"),
    (OK_BODY | {"messages": [{"role": "user", "content": "sea " * 400}]}, KEY, 400, "fills the context", None),
    ({"model": "m"}, KEY, 400, "missing required field 'messages'", "messages"),
    (OK_BODY, None, 401, "API key", None),
    (OK_BODY, "sk-wrong", 401, "API key", None),
])
def test_bad_request_gets_status_and_openai_error(server, body, key, status, fragment, param):
    got, err, _ = server.post(CHAT, body, key=key)
    assert got == status, err
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
    assert fragment.lower() in err["error"]["message"].lower(), err
    assert err["error"]["type"] == ("authentication_error" if status == 401 else "invalid_request_error")
    if param:
        assert err["error"]["param"] == param


def test_server_healthy_after_bad_requests(server, reference):
    status, body = server.get("/no/such/page")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"
    got, err, _ = server.post("/v1/completions", {"prompt": ["a", "b"]})
    assert got == 400 and "one prompt" in err["error"]["message"]
    assert server.health()["status"] == "ok"
    got, ok, _ = server.post(CHAT, OK_BODY | {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16,
                                              "temperature": 0})
    assert got == 200 and ok["choices"][0]["message"]["content"] == reference["text"]


def test_metrics(server):
    _, text = server.get("/metrics")
    for name in ("subspec_generated_tokens_total", "subspec_target_forwards_total", "subspec_tau",
                 "subspec_bytes_streamed_total", "subspec_queue_depth", "subspec_request_latency_seconds_bucket",
                 "subspec_time_to_first_token_seconds_count", "subspec_cached_tokens_total"):
        assert name in text, name
    assert server.metric("subspec_generated_tokens_total") > 0 and server.metric("subspec_bytes_streamed_total") > 0
    assert server.metric("subspec_requests_total", endpoint=CHAT, status="200") > 0
    assert server.metric("subspec_requests_total", endpoint=CHAT, status="401") >= 2
    assert server.metric("subspec_queue_depth") == 0
    tau = server.metric("subspec_tau_overall")  # generated tokens / target forwards, over every finished job
    assert tau == pytest.approx(server.metric("subspec_generated_tokens_total")
                                / server.metric("subspec_target_forwards_total"))
    assert 1 <= tau <= 5  # a forward emits at most depth 4 + the bonus token
    # one more request moves each counter by exactly what that request reports
    names = ("subspec_generated_tokens_total", "subspec_prompt_tokens_total", "subspec_request_latency_seconds_count",
             "subspec_time_to_first_token_seconds_count", "subspec_rounds_total")
    timeline = {("subspec_round_seconds_total", p): f"{p}_seconds" for p in ("draft", "verify", "verify_wait")}
    timeline |= {("subspec_disk_busy_seconds_total", p): f"{p}_disk_seconds" for p in ("draft", "verify")}
    before = {n: server.metric(n) for n in names} | {k: server.metric(k[0], phase=k[1]) for k in timeline}
    ok_before = server.metric("subspec_requests_total", endpoint=CHAT, status="200")
    got, body, _ = server.post(CHAT, OK_BODY | {"messages": [{"role": "user", "content": "Name a colour."}],
                                                "max_tokens": 5, "temperature": 0})
    assert got == 200
    after = {n: server.metric(n) for n in names}
    assert after["subspec_generated_tokens_total"] - before["subspec_generated_tokens_total"] == \
        body["usage"]["completion_tokens"]
    assert after["subspec_prompt_tokens_total"] - before["subspec_prompt_tokens_total"] == body["usage"]["prompt_tokens"]
    assert after["subspec_request_latency_seconds_count"] - before["subspec_request_latency_seconds_count"] == 1
    assert after["subspec_time_to_first_token_seconds_count"] - before["subspec_time_to_first_token_seconds_count"] == 1
    assert server.metric("subspec_requests_total", endpoint=CHAT, status="200") - ok_before == 1
    # the rounds' timeline moves by the request's own (its subspec object), and its phases add up
    st = body["subspec"]
    assert after["subspec_rounds_total"] - before["subspec_rounds_total"] == st["rounds"] >= 1
    for (name, phase), key in timeline.items():
        assert server.metric(name, phase=phase) - before[(name, phase)] == pytest.approx(st[key], abs=1e-6), key
    assert 0 <= st["verify_wait_seconds"] <= st["verify_seconds"] and st["draft_seconds"] > 0
    assert st["draft_seconds"] + st["verify_seconds"] <= st["generation_seconds"]


# ---- the page in a real browser ----------------------------------------------------------------------------
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def test_chat_page_in_headless_chromium(server, reference, tmp_path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install -y chromium "
                    "chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install -e '.[test]'")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,800"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        driver.set_page_load_timeout(60)
        driver.get(server.url + "/")
        WebDriverWait(driver, 30).until(lambda d: "SmolLM2" in d.find_element(By.ID, "model").text)
        driver.find_element(By.ID, "api-key").send_keys(KEY)
        box = driver.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys(str(DEFAULT_MAX_TOKENS))
        driver.find_element(By.ID, "prompt").send_keys(PROMPT)
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .round"))
        stats = WebDriverWait(driver, 300).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats[data-done='1']"))[0]
        answer = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .text")
        assert answer.text == reference["text"].strip()  # the page's greedy answer is the API's
        tau = float(stats.find_element(By.CLASS_NAME, "tau").text)
        m = re.search(r"\((\d+) tokens / (\d+) target forwards\)", stats.text)
        assert m and tau == pytest.approx(int(m.group(1)) / int(m.group(2)), abs=0.01), stats.text
        assert "streamed" in stats.text and float(stats.find_element(By.CLASS_NAME, "tps").text) > 0
        bands = answer.find_elements(By.CLASS_NAME, "round")
        assert len(bands) == int(m.group(2))  # one shaded band per target forward
        assert sum(int(b.get_attribute("data-tokens")) for b in bands) == int(m.group(1)) == reference["tokens"]
        shot = tmp_path / "chat.png"
        assert driver.save_screenshot(str(shot))
    finally:
        driver.quit()
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size[0] >= 800 and img.size[1] >= 600
    lo, hi = img.convert("L").getextrema()
    colours = img.getcolors(maxcolors=1 << 20)
    assert hi - lo > 100 and len(colours) > 50, "the screenshot is blank"
    keep = os.environ.get("SUBSPEC_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / "chat.png")


# ---- stopping ----------------------------------------------------------------------------------------------
def test_sigterm_stops_cleanly_during_a_stream(server):
    """Last: SIGTERM while a request streams: the stream ends, the server exits 0 and says so, no traceback."""
    stream = _chat(server.client(max_retries=0), [{"role": "user", "content": LONG}], max_tokens=300, stream=True)
    it = iter(stream)
    next(it)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    got = 0
    try:
        for _ in it:
            got += 1
            if got > 400:
                break
    except Exception:  # noqa: BLE001 - the connection may end abruptly, which is what we want here
        pass
    assert got <= 400
    log = server.log.read_text()
    assert "server stopped (SIGTERM)" in log and "Traceback" not in log, log


def test_serve_option_errors(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = run_cli("serve", "--port", str(busy), "--model", str(tmp_path / "none"), timeout=120)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("serve", "--port", "70000", timeout=120)
    assert r.returncode == 2 and "--port must be in 1..65535" in r.stderr
