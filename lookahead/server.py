"""``lookahead serve``: an OpenAI-compatible HTTP API over one ``LookaheadGenerator``.

    POST /v1/completions        prompt: text, or a list of token ids (tokenizer-free); "return_token_ids"
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models  /health  /metrics (Prometheus)

Both POST endpoints stream with ``"stream": true`` (server-sent events, one chunk per accepted batch of
tokens, then ``[DONE]``). Requests run one at a time (batch size 1) in a worker thread, in arrival order;
more than ``queue_limit`` waiting or running get 429. A client that disconnects mid-stream stops its
generation at the next step. All requests share one drafting state (pools, recycling table, acceptance
statistics), saved on shutdown and loaded at start with ``--state``: later requests draft better.
Errors are OpenAI-style JSON bodies with a 4xx status; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse

from lookahead.drafting import SOURCES, DraftState
from lookahead.generator import LookaheadGenerator


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class _Common(BaseModel):
    # unknown fields are checked by name below, not silently dropped; strict: true is no 1, "1" no 1;
    # no infinite or NaN numbers (Python's JSON parser takes Infinity and NaN)
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = Field(default=None, gt=0)
    logprobs: Any = None
    echo: bool = False
    user: str | None = None
    stream_options: dict | None = None


class CompletionRequest(_Common):
    prompt: Any  # text, token ids, or a list of one of either: checked by ``Server.prepare``
    return_token_ids: bool = False


class ChatRequest(_Common):
    messages: list[dict]
    return_token_ids: bool = False


IGNORED = {"user", "stream_options"}  # accepted and without effect on the output


class _Channel:
    """A streamer from the worker thread to the event loop; raises in the thread once the client has gone."""

    class Cancelled(Exception):
        pass

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue, self.cancelled, self.prompt_seen = loop, asyncio.Queue(), False, False

    def put(self, ids) -> None:
        if self.cancelled:
            raise _Channel.Cancelled()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ids.tolist())

    def end(self) -> None:
        pass


class Server:
    """The generator, its shared drafting state, the request queue and the metrics."""

    def __init__(self, gen: LookaheadGenerator, model_name: str, state: DraftState | None = None, queue_limit: int = 16,
                 state_path: Path | None = None) -> None:
        self.gen, self.model_name, self.queue_limit, self.state_path = gen, model_name, queue_limit, state_path
        self.state = state or gen.new_state()
        self.lock = asyncio.Lock()
        self.pending = 0
        self.state_lock = threading.Lock()
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter("lookahead_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.m_tokens = Counter("lookahead_generated_tokens", "Tokens generated", registry=r)
        self.m_steps = Counter("lookahead_decode_steps", "Decode forwards (after the prefill)", registry=r)
        self.m_accepted = Counter("lookahead_accepted_draft_tokens", "Emitted draft tokens by source", ["source"], registry=r)
        self.m_queue = Gauge("lookahead_queue_length", "Requests waiting or running", registry=r)
        self.m_latency = Histogram("lookahead_request_seconds", "Request latency", registry=r)
        self.m_tps = Gauge("lookahead_last_tokens_per_second", "Tokens/s of the last request", registry=r)
        self.m_compression = Gauge("lookahead_last_compression", "Tokens per forward of the last request", registry=r)

    # -- requests -------------------------------------------------------------------------------

    def prepare(self, req: _Common, chat: bool) -> tuple[Any, dict, list[str]]:
        """(prompt for generate, its keyword arguments, stop strings) or an APIError."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}", "model", "model_not_found")
        extra = set(req.model_extra or {}) - IGNORED
        if extra:
            raise APIError(400, f"unsupported parameter(s): {', '.join(sorted(extra))}", sorted(extra)[0])
        for name, ok in (("n", req.n == 1), ("best_of", req.best_of in (None, 1)), ("logprobs", req.logprobs in (None, False, 0)),
                         ("echo", not req.echo), ("presence_penalty", req.presence_penalty == 0),
                         ("frequency_penalty", req.frequency_penalty == 0)):
            if not ok:
                raise APIError(400, f"{name}={getattr(req, name)!r} is not supported (one greedy or sampled sequence per request)", name)
        tokenizer = self.gen.tokenizer
        if chat:
            if tokenizer is None or not tokenizer.chat_template:
                raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
            if not req.messages or any(not isinstance(m.get("content"), str) for m in req.messages):
                raise APIError(400, "messages must be a non-empty list of {role, content} with text content", "messages")
            try:
                prompt = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as e:  # a template that rejects the conversation (roles, order)
                raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        else:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise APIError(400, "one prompt per request (batch size 1)", "prompt")
                prompt = prompt[0]
            if not (isinstance(prompt, str) or isinstance(prompt, list) and all(type(t) is int for t in prompt)):
                raise APIError(400, "prompt must be text or a list of token ids (integers), or a list of one of either", "prompt")
            if isinstance(prompt, str) and tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        stops = [s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or []) if s]  # "" is no stop (OpenAI)
        if stops and tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none", "stop")
        sample = req.temperature is None or req.temperature > 0  # OpenAI's default temperature is 1
        options: dict[str, Any] = {"do_sample": sample}
        if sample:
            options |= {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k)) if v is not None}
            options.setdefault("temperature", 1.0)
            options.setdefault("top_k", 0)  # OpenAI has no top-k unless asked (generate()'s default is 50)
        if req.repetition_penalty is not None:
            options["repetition_penalty"] = req.repetition_penalty
        if stops:
            options["stop_strings"] = stops
        max_tokens = req.max_completion_tokens or req.max_tokens or 16
        return prompt, dict(max_new_tokens=max_tokens, seed=req.seed, **options), stops

    def run(self, prompt, kwargs: dict, streamer=None):
        """One generation in the worker thread, on the shared drafting state; ValueErrors become 400s."""
        try:
            with self.state_lock:
                return self.gen.generate(prompt, streamer=streamer, state=self.state, **kwargs)
        except ValueError as e:
            raise APIError(400, str(e).strip().splitlines()[0], "prompt" if "prompt" in str(e) or "token id" in str(e) else None) from None

    def record(self, endpoint: str, out, started: float) -> None:
        stats = out.stats
        self.m_requests.labels(endpoint, "200").inc()
        self.m_tokens.inc(stats.new_tokens)
        self.m_steps.inc(stats.steps)
        for source in SOURCES:
            self.m_accepted.labels(source).inc(stats.accepted_by_source.get(source, 0))
        self.m_latency.observe(time.perf_counter() - started)
        self.m_tps.set(stats.tokens_per_s)
        self.m_compression.set(stats.compression)

    def text_of(self, tokens: list[int], stops: list[str]) -> tuple[str, bool]:
        """Decoded text cut before the first stop string (OpenAI leaves it out), and whether one was found."""
        if self.gen.tokenizer is None:
            return "", False
        text = self.gen.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in stops if s in text]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def save_state(self) -> None:
        if self.state_path is not None:
            with self.state_lock:
                self.state.save(self.state_path)


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.save_state()  # the warm drafting state outlives the process

    app = FastAPI(title="lookahead", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        server.m_requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # its loc holds the character offset, not a parameter
            return await api_error(request, APIError(400, f"malformed JSON body at character {first['loc'][-1]}: "
                                                          f"{first.get('ctx', {}).get('error', 'cannot parse')}"))
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        return await api_error(request, APIError(400, f"invalid request: {where}: {first.get('msg', 'malformed body')}", where))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_name, "queue": server.pending}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0, "owned_by": "lookahead"}]}

    @app.get("/metrics")
    async def metrics():
        server.m_queue.set(server.pending)
        return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        return await handle(req, chat=True)

    async def handle(req: _Common, chat: bool):
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        prompt, kwargs, stops = server.prepare(req, chat)
        if server.pending >= server.queue_limit:
            raise APIError(429, f"server busy: {server.pending} requests queued (limit {server.queue_limit}); retry later",
                           kind="rate_limit_exceeded")
        server.pending += 1
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())
        head = {"id": rid, "created": created, "model": server.model_name}
        if req.stream:
            return EventSourceResponse(stream(head, prompt, kwargs, stops, chat, endpoint, req.return_token_ids), ping=15)
        started = time.perf_counter()
        try:
            async with server.lock:
                out = await asyncio.to_thread(server.run, prompt, kwargs)
        finally:
            server.pending -= 1
        server.record(endpoint, out, started)
        text, stopped = server.text_of(out.tokens, stops)
        reason = "stop" if stopped or out.finish_reason == "stop" else "length"
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        if req.return_token_ids or server.gen.tokenizer is None:
            choice["token_ids"] = out.tokens
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(server.gen.tokenizer(prompt)["input_ids"])
        return head | {"object": "chat.completion" if chat else "text_completion", "choices": [choice],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(out.tokens),
                                 "total_tokens": prompt_tokens + len(out.tokens)},
                       "lookahead": out.stats.as_dict()}

    async def stream(head, prompt, kwargs, stops, chat, endpoint, with_ids):
        """Server-sent events: a chunk per accepted batch, the text held back while it could still become a stop string."""
        channel = _Channel(asyncio.get_running_loop())
        kind = "chat.completion.chunk" if chat else "text_completion"
        hold = max((len(s) for s in stops), default=1) - 1
        started, task, getter = time.perf_counter(), None, None

        def chunk(text: str, ids: list[int], reason: str | None, **extra) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            choice |= {"delta": ({"role": "assistant", "content": text} if text or reason is None else {})} if chat else {"text": text}
            if with_ids or server.gen.tokenizer is None:
                choice["token_ids"] = ids
            return json.dumps(head | {"object": kind, "choices": [choice]} | extra)

        try:
            async with server.lock:
                task = asyncio.ensure_future(asyncio.to_thread(server.run, prompt, kwargs, channel))
                tokens, sent, stopped = [], 0, False
                while not stopped:
                    getter = asyncio.ensure_future(channel.queue.get())
                    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        if channel.queue.empty():
                            break
                        new = channel.queue.get_nowait()
                    else:
                        new = getter.result()
                    tokens += new
                    text, stopped = server.text_of(tokens, stops)
                    upto = len(text) if stopped else max(sent, len(text) - hold)
                    if server.gen.tokenizer is not None and text.endswith("\ufffd"):
                        upto = min(upto, len(text) - 1)
                    if upto > sent or with_ids or server.gen.tokenizer is None:
                        yield chunk(text[sent:upto], new, None)
                        sent = upto
                try:
                    out = await task
                except _Channel.Cancelled:
                    out = None
                except APIError as e:
                    yield json.dumps({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}})
                    return
                text, stopped = server.text_of(tokens, stops)
                reason = "stop" if stopped or (out is not None and out.finish_reason == "stop") else "length"
                extra = {}
                if out is not None:
                    server.record(endpoint, out, started)
                    extra = {"usage": {"prompt_tokens": len(prompt) if isinstance(prompt, list) else None,
                                       "completion_tokens": len(out.tokens)}, "lookahead": out.stats.as_dict()}
                yield chunk(text[sent:], [], reason, **extra)
                yield "[DONE]"
        finally:  # also when the client went away: the generation stops at its next step (``state_lock`` keeps
            channel.cancelled = True  # the next request's generation from starting before that)
            server.pending -= 1
            if getter is not None:
                getter.cancel()
            if task is not None:
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: nothing to log

    return app


@contextlib.contextmanager
def background(server: Server, host: str = "127.0.0.1", port: int = 0):
    """The app under uvicorn in a daemon thread, for tests, benchmarks and embedding; yields its base URL.
    On exit the server shuts down (lifespan included: the state is saved)."""
    import socket

    import uvicorn

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not uv.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=60)


def serve(gen: LookaheadGenerator, model_name: str, host: str, port: int, state_path: Path | None, queue_limit: int) -> None:
    import uvicorn

    state = DraftState.load(state_path) if state_path is not None and state_path.exists() else None
    if state is not None:
        state.check_fits(gen.vocab_size, gen.config)
    app = create_app(Server(gen, model_name, state, queue_limit, state_path))
    uvicorn.run(app, host=host, port=port, log_level="info")
