"""The FastAPI application: OpenAI-compatible endpoints, health, Prometheus metrics and the chat page.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as Server-Sent
Events ending with ``data: [DONE]``, or one JSON response), ``GET /health``, ``GET /metrics``, and the static chat
page at ``/``. Every completion carries a ``subspec`` object: tau (new tokens / target forwards, the prefill counted
as the forward that emits the first token), tokens/s, target forwards, bytes streamed from the offload tier and the
prompt tokens prefilled vs reused from the cache, and where its drafting rounds' time went (draft, verify, the verify
blocked on the offload tier, the disk busy meanwhile). Streamed chunks carry ``subspec: {"round": i, "tokens": n}``: each
chunk is one engine round (one target forward), so a client can show how many tokens each forward produced.

The server adds no decode path: one :class:`~subspec.server.jobs.EngineWorker` drives the runtime's one engine.
"""
from __future__ import annotations

import asyncio
import copy
import json
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from ..errors import SubspecError
from ..runtime import encode_messages
from ..sampling import SamplingParams
from .jobs import EngineWorker, Failed, Finished, Job, Round
from .metrics import Metrics
from .schema import ApiError, ChatRequest, CompletionRequest, GenerationRequest, validation_error

STATIC = Path(__file__).parent / "static"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/")


@dataclass
class ServerSettings:
    """How the server answers. ``model_name``: the id shown by /v1/models. ``api_key``: required as a Bearer token
    on /v1/* when set. ``max_queue``: requests that may wait behind the running one (more get 429).
    ``defaults``: sampling values for requests that leave them out (max_new_tokens is the default max_tokens,
    lowered to what the context has room for)."""

    model_name: str
    api_key: Optional[str] = None
    max_queue: int = 16
    defaults: SamplingParams = field(default_factory=lambda: SamplingParams(max_new_tokens=256))


def create_app(rt, settings: ServerSettings) -> FastAPI:
    """The app serving ``rt`` (a loaded :class:`~subspec.runtime.Runtime`). Its engine worker starts with the app
    (lifespan) and is closed when the app shuts down (the running request is cancelled at its next round); the
    caller closes ``rt`` afterwards."""
    encoder = Encoder(rt.tokenizer)
    tokenizer = encoder.tokenizer  # read for its chat template only: encoding goes through encoder
    created = int(time.time())
    state: dict = {}
    metrics = Metrics(lambda: state["worker"].depth if "worker" in state else 0)

    @asynccontextmanager
    async def lifespan(app):
        state["worker"] = EngineWorker(rt, settings.max_queue, on_finish=lambda job, done: metrics.finished_job(done))
        try:
            yield
        finally:
            try:
                await asyncio.to_thread(state["worker"].close)
            finally:
                encoder.close()

    app = FastAPI(title="subspec", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.add_middleware(_CountRequests, metrics=metrics)

    # ---- errors: always OpenAI's error JSON ----------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        err = ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        err = ApiError(500, f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(err.body(), status_code=500)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key given "
                                "to --api-key", code="invalid_api_key")

    # ---- endpoints ------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        w, job = state["worker"], state["worker"].running
        return {"status": "ok", "model": settings.model_name, "placement": rt.placement.summary(),
                "max_context": rt.engine.max_context, "queue_depth": w.depth, "busy": job is not None,
                "running": None if job is None else {"rounds": job.rounds, "tokens": job.tokens}}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": created,
                                            "owned_by": "subspec", "max_context": rt.engine.max_context,
                                            "placement": rt.placement.summary()}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        authorize(request)
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions", code="no_chat_template")
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            ids = await encoder.run(encode_messages, msgs)
        except SubspecError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await generate(request, body, ids, chat=True, max_tokens=body.max_completion_tokens or body.max_tokens)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        authorize(request)
        text = body.prompt_text()
        if not text:
            raise ApiError(400, "prompt: the prompt is empty", param="prompt")
        ids = await encoder.run(lambda tok, t: list(tok(t)["input_ids"]), text)
        return await generate(request, body, ids, chat=False, max_tokens=body.max_tokens)

    # ---- generation -----------------------------------------------------------------------------------------
    def sampling(body: GenerationRequest, n_prompt: int, max_tokens: Optional[int]) -> SamplingParams:
        d, room = settings.defaults, rt.engine.max_context - n_prompt
        if room < 1:
            raise ApiError(400, f"the prompt ({n_prompt} tokens) fills the context of {rt.engine.max_context} "
                                f"tokens: shorten it (or start the server with a larger --max-context)",
                           param="messages", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens ({max_tokens}) + the prompt ({n_prompt} tokens) exceeds the context of "
                                f"{rt.engine.max_context} tokens: ask for at most {room}", param="max_tokens",
                           code="context_length_exceeded")
        p = SamplingParams(temperature=d.temperature if body.temperature is None else body.temperature,
                           top_p=d.top_p if body.top_p is None else body.top_p,
                           top_k=d.top_k if body.top_k is None else body.top_k,
                           seed=d.seed if body.seed is None else body.seed,
                           max_new_tokens=max_tokens if max_tokens is not None else min(d.max_new_tokens, room))
        try:
            return p.validate()
        except SubspecError as e:
            raise ApiError(400, str(e)) from None

    async def generate(request: Request, body: GenerationRequest, ids: list[int], chat: bool,
                       max_tokens: Optional[int]):
        arrived = time.monotonic()
        job = Job(ids, sampling(body, len(ids), max_tokens), body.stop_strings(), asyncio.get_running_loop())
        state["worker"].submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        shape = _Shape(rid, settings.model_name, chat)
        if body.stream:
            return EventSourceResponse(_sse(job, shape, body.include_usage(), arrived), ping=15)
        try:
            text, done = await _collect(job, request, arrived)
        finally:
            job.cancel()  # no-op when finished; stops the engine when this request was cancelled
        if done is None:  # the client left
            return Response(status_code=499)
        return shape.response(text, done)

    async def _collect(job: Job, request: Request, arrived: float):
        pieces: list[str] = []
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return "", None
                continue
            if isinstance(ev, Round):
                if ev.index == 0 and ev.tokens:
                    metrics.first_token.observe(time.monotonic() - arrived)
                pieces.append(ev.text)
            elif isinstance(ev, Failed):
                raise ev.error
            else:
                metrics.latency.observe(time.monotonic() - arrived)
                return "".join(pieces), ev

    async def _sse(job: Job, shape: "_Shape", include_usage: bool, arrived: float):
        try:
            while True:
                ev = await job.events.get()
                if isinstance(ev, Round):
                    if ev.index == 0 and ev.tokens:
                        metrics.first_token.observe(time.monotonic() - arrived)
                    yield {"data": json.dumps(shape.chunk(ev))}
                elif isinstance(ev, Failed):
                    yield {"data": json.dumps(ev.error.body())}
                    break
                else:
                    metrics.latency.observe(time.monotonic() - arrived)
                    yield {"data": json.dumps(shape.final_chunk(ev))}
                    if include_usage:
                        yield {"data": json.dumps(shape.usage_chunk(ev))}
                    break
            yield {"data": "[DONE]"}
        finally:
            job.cancel()  # the client disconnected (or the server is stopping): the engine stops within one round

    # ---- the chat page ------------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


class Encoder:
    """Where the server encodes prompts: one thread of its own with its own copy of the tokenizer, so a long prompt
    never blocks the event loop (other clients, health, streams) and no tokenizer object is ever used by two threads
    at once (Hugging Face's fast tokenizers fail with "Already borrowed"): the engine worker decodes with the runtime's
    tokenizer on its thread, this thread encodes with the copy. Prompts are encoded one after another, in arrival
    order."""

    def __init__(self, tokenizer):
        self.tokenizer = copy.deepcopy(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="subspec-encoder")

    async def run(self, fn, *args):
        """``fn(tokenizer, *args)`` on the encoder thread; its result or its exception."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self.tokenizer, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Shape:
    """OpenAI response shapes for one request (chat.completion / text_completion, whole or as chunks)."""

    def __init__(self, rid: str, model: str, chat: bool):
        self.rid, self.model, self.chat, self.created = rid, model, chat, int(time.time())
        self.obj = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: Optional[str], finish: Optional[str], first: bool = False, whole: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                    "logprobs": None}
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}

    @staticmethod
    def usage(done: Finished) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

    def response(self, text: str, done: Finished) -> dict:
        return self._head(self.obj) | {"choices": [self._choice(text, done.finish_reason, whole=True)],
                                       "usage": self.usage(done), "subspec": done.stats}

    def chunk(self, ev: Round) -> dict:
        obj = self.obj + (".chunk" if self.chat else "")
        return self._head(obj) | {"choices": [self._choice(ev.text, None, first=ev.index == 0)],
                                  "subspec": {"round": ev.index, "tokens": ev.tokens}}

    def final_chunk(self, done: Finished) -> dict:
        obj = self.obj + (".chunk" if self.chat else "")
        return self._head(obj) | {"choices": [self._choice(None, done.finish_reason)], "subspec": done.stats}

    def usage_chunk(self, done: Finished) -> dict:
        obj = self.obj + (".chunk" if self.chat else "")
        return self._head(obj) | {"choices": [], "usage": self.usage(done)}


class _CountRequests:
    """ASGI middleware: counts answered requests by endpoint and status (no buffering, streaming untouched)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else ("/static" if path.startswith("/static/") else "other")
            self.metrics.requests.labels(endpoint, str(status)).inc()
