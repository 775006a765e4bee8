"""``lookahead serve``: an OpenAI-compatible HTTP API over one ``LookaheadGenerator``.

    POST /v1/completions        prompt: text, or a list of token ids (tokenizer-free); "return_token_ids"
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models  /health  /metrics (Prometheus)

Both POST endpoints stream with ``"stream": true`` (server-sent events, one chunk per accepted batch of
tokens, then ``[DONE]``). Requests are batched continuously (``scheduler.py``): each joins the running batch
at the next step, up to ``max_batch`` together (its prompt prefilled ``prefill_chunk`` tokens a step while
others decode), and leaves when done; more than ``queue_limit`` waiting or
running get 429. A client that disconnects stops its generation at the next step. ``"lookahead": false``
decodes a request plainly (one token per forward) inside the same batch. All requests share one drafting
state (pools, recycling table, acceptance statistics), saved on shutdown and loaded at start with
``--state``: later requests draft better. Finished requests' keys are kept (``held_keys`` bytes, the most recently
used first) where reusing them gives the same bits (``LookaheadGenerator.reuses_keys``): a prompt that begins with
one of them (a chat client sends the whole conversation each turn) prefills only the rest, and its usage says how
many tokens it did not prefill (``prompt_tokens_details.cached_tokens``, as OpenAI's).
Errors are OpenAI-style JSON bodies with a 4xx status, also for a streamed request (checked before its stream
starts); request bodies past ``max_body_bytes`` get 413. The server keeps serving. With ``api_key`` set, every
endpoint but ``/health`` needs ``Authorization: Bearer <key>`` (a 401 otherwise, before the body is read).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from lookahead.api import APIError, BodyLimit, ChatRequest, CompletionRequest, check_request
from lookahead.auth import RequireKey, check_api_key
from lookahead.config import HELD_KEYS_BYTES, MAX_BODY_BYTES, PREFILL_CHUNK
from lookahead.drafting import SOURCES, DraftState
from lookahead.generator import GenerationResult, LookaheadGenerator
from lookahead.kv import RecentKeys
from lookahead.lane import Lane
from lookahead.prompt import chat_ids, check_text
from lookahead.rules import TokenLogprob
from lookahead.scheduler import Scheduler

ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})


class _Channel:
    """A streamer from the worker thread to the event loop (the prompt is not echoed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue, self.prompt_seen = loop, asyncio.Queue(), False

    def put(self, ids) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ids.tolist())

    def end(self) -> None:
        pass


def _settle(future: asyncio.Future, result) -> None:
    if not future.done():  # its request may have been cancelled meanwhile
        future.set_exception(result) if isinstance(result, BaseException) else future.set_result(result)


class Server:
    """The generator (its own drafting state is the one every request shares), the request queue and the metrics."""

    def __init__(self, gen: LookaheadGenerator, model_name: str, state: DraftState | None = None, queue_limit: int = 16,
                 state_path: Path | None = None, max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None,
                 max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK, held_keys: int = HELD_KEYS_BYTES) -> None:
        self.gen, self.model_name, self.queue_limit, self.state_path = gen, model_name, queue_limit, state_path
        self.keys = RecentKeys(held_keys)  # a bad budget raises here
        self.keeps_keys = held_keys > 0 and gen.reuses_keys  # (a probe: a few forwards, before any request runs)
        self.max_body_bytes = max_body_bytes
        self.api_key = None if api_key is None else check_api_key(api_key).encode()  # bytes: compared in constant time
        gen.own_state(state)  # a loaded one, else the generator's own as it is
        self.pending = 0
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter("lookahead_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.m_tokens = Counter("lookahead_generated_tokens", "Tokens generated", registry=r)
        self.m_steps = Counter("lookahead_decode_steps", "Decode forwards (after the prefill)", registry=r)
        self.m_reused = Counter("lookahead_reused_prompt_tokens", "Prompt tokens not prefilled: their keys were held", registry=r)
        self.m_held = Gauge("lookahead_held_keys_bytes", "Bytes of finished requests' keys held for later prompts", registry=r)
        self.m_accepted = Counter("lookahead_accepted_draft_tokens", "Emitted draft tokens by source", ["source"], registry=r)
        self.m_queue = Gauge("lookahead_queue_length", "Requests waiting or running", registry=r)
        self.m_batch = Gauge("lookahead_batch_size", "Requests decoding together in the running batch", registry=r)
        self.m_step_batch = Histogram("lookahead_step_batch_size", "Requests carried by each decode step", registry=r,
                                      buckets=(1, 2, 4, 8, 16, 32, 64))
        self.scheduler = Scheduler(gen, max_batch, gen.state_lock, self.m_step_batch.observe, prefill_chunk)
        self.m_latency = Histogram("lookahead_request_seconds", "Request latency", registry=r)
        self.m_tps = Gauge("lookahead_last_tokens_per_second", "Tokens/s of the last request", registry=r)
        self.m_compression = Gauge("lookahead_last_compression", "Tokens per forward of the last request", registry=r)

    # -- requests -------------------------------------------------------------------------------

    def lane(self, prompt: str | list[int] | list[dict], chat: bool, kwargs: dict, streamer=None) -> Lane:
        """The request checked as ``generate`` checks it (vocabulary, context, options), ready to join the batch, or
        a 400. In the worker thread: a chat template over a long conversation takes seconds."""
        try:
            if chat:
                for i, m in enumerate(prompt):
                    check_text(f"message {i} of the prompt", m["content"])
                prompt = chat_ids(self.gen.tokenizer, prompt)
                context = self.gen.reach.context
                if kwargs["max_new_tokens"] is None and context is not None:  # a reply without a bound: up to the context's end
                    kwargs = kwargs | {"max_new_tokens": max(context - len(prompt), 1)}
            return self.gen.new_lane(prompt, state=self.gen.own_state(), streamer=streamer, keys=self.keys if self.keeps_keys else None,
                                     keeps_keys=self.keeps_keys, **kwargs)
        except ValueError as e:
            message = str(e).strip().splitlines()[0]
            on_prompt = any(word in message for word in ("prompt", "token id", "chat template"))
            param = ("messages" if chat else "prompt") if on_prompt else "stop" if "stop string" in message else None
            raise APIError(400, message, param) from None

    def submit(self, lane: Lane) -> asyncio.Future:
        """Queue a checked request into the running batch; the future gets its ``GenerationResult``."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(finished: Lane | BaseException) -> None:  # in the worker thread
            if isinstance(finished, Lane) and finished.keys is not None:
                self.m_held.set(self.keys.add(finished.keys))
            result = finished if isinstance(finished, BaseException) else self.gen.result(finished)
            loop.call_soon_threadsafe(_settle, future, result)

        self.scheduler.submit(lane, done)
        return future

    def record(self, endpoint: str, out, started: float) -> None:
        stats = out.stats
        self.m_requests.labels(endpoint, "200").inc()
        self.m_tokens.inc(stats.new_tokens)
        self.m_steps.inc(stats.steps)
        self.m_reused.inc(stats.reused_tokens)
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

    def logprobs(self, logprobs: list[TokenLogprob] | None, chat: bool) -> dict | None:
        """A choice's ``logprobs`` as OpenAI's: a chat's ``content`` list (token, logprob, bytes, top_logprobs), a legacy
        completion's parallel lists (tokens, token_logprobs, top_logprobs, text_offset); None where none was asked.
        A token is its own decoded text (``token_id:<id>`` without a tokenizer, as vLLM names them); an echoed prompt's
        first token has no log-probability (None, as OpenAI's)."""
        if logprobs is None:
            return None
        tokenizer = self.gen.tokenizer
        name = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: f"token_id:{t}")
        if chat:
            entry = lambda text, p: {"token": text, "logprob": p, "bytes": list(text.encode())}
            return {"content": [entry(name(lp.token), lp.logprob) | {"top_logprobs": [entry(name(t), p) for t, p in lp.top]}
                                for lp in logprobs]}
        tokens = [name(lp.token) for lp in logprobs]
        offsets = [0, *itertools.accumulate(len(t) for t in tokens)][: len(tokens)]  # where each begins in the text
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{name(t): p for t, p in lp.top} if lp.top is not None else None for lp in logprobs], "text_offset": offsets}

    def close(self) -> None:
        """Stop the batch worker and keep the warm drafting state."""
        self.scheduler.stop()
        self.save_state()

    def save_state(self) -> None:
        if self.state_path is not None:
            with self.gen.state_lock:
                self.gen.own_state().save(self.state_path)

    def error_response(self, path: str, e: APIError, code: int | str | None = None,
                       headers: dict[str, str] | None = None) -> JSONResponse:
        """An OpenAI-style error body (``code``: the status unless given), counted in the metrics under its route,
        or ``other``: a label per path a client sends would grow the metrics without bound."""
        self.m_requests.labels(path if path in ROUTES else "other", str(e.status)).inc()
        body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status if code is None else code}}
        return JSONResponse(body, status_code=e.status, headers=headers)


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.close()  # the warm drafting state outlives the process

    app = FastAPI(title="lookahead", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=server.max_body_bytes)
    if server.api_key is not None:  # added last: the outermost, it answers before the body limit or the app run
        app.add_middleware(RequireKey, key=server.api_key, deny=server.error_response)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return server.error_response(request.url.path, e)

    @app.exception_handler(HTTPException)  # Starlette's own: unknown routes, bodies past the limit
    async def http_error(request: Request, e: HTTPException):
        detail = f"request body over the server's limit of {server.max_body_bytes} bytes" if e.status_code == 413 else e.detail
        return await api_error(request, APIError(e.status_code, detail))

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
        server.m_batch.set(server.scheduler.running)
        return Response(generate_latest(server.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        return await handle(req, chat=True)

    async def handle(req: CompletionRequest | ChatRequest, chat: bool):
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        prompt, kwargs, stops = check_request(req, chat, server.model_name, server.gen.tokenizer)
        if server.pending >= server.queue_limit:
            raise APIError(429, f"server busy: {server.pending} requests queued (limit {server.queue_limit}); retry later",
                           kind="rate_limit_exceeded")
        server.pending += 1
        channel = _Channel(asyncio.get_running_loop()) if req.stream else None
        try:  # before any answer, so that bad input is a 400 for a stream too (as OpenAI answers)
            lane = await asyncio.to_thread(server.lane, prompt, chat, kwargs, channel)
        except BaseException:
            server.pending -= 1
            raise
        ids = lane.prompt
        echo = (prompt if isinstance(prompt, str) else server.text_of(ids, [])[0]) if req.echo else None  # the prompt as sent
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())
        head = {"id": rid, "created": created, "model": server.model_name}
        if req.stream:  # the stream frees its queue slot when it ends
            return EventSourceResponse(stream(head, lane, channel, stops, chat, endpoint, req.return_token_ids, echo), ping=15)
        started = time.perf_counter()
        try:
            out = await server.submit(lane)
        finally:  # also when the client went away: the lane leaves the batch at its next step
            lane.cancelled = not lane.finished
            server.pending -= 1
        server.record(endpoint, out, started)
        text, stopped = server.text_of(out.tokens, stops)
        reason = "stop" if stopped or out.finish_reason == "stop" else "length"
        logprobs = out.logprobs
        if echo is not None:
            text, logprobs = echo + text, echoed(lane, logprobs)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": server.logprobs(logprobs, chat)}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        if req.return_token_ids or server.gen.tokenizer is None:
            choice["token_ids"] = out.tokens
        return head | {"object": "chat.completion" if chat else "text_completion", "choices": [choice],
                       "usage": usage(ids, out), "lookahead": out.stats.as_dict()}

    def echoed(lane: Lane, logprobs: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """An echo's log-probabilities: the prompt's tokens' (the first has none), then ``logprobs``."""
        return None if logprobs is None else [lp or TokenLogprob(lane.prompt[0], None, None) for lp in lane.prompt_logprobs] + logprobs

    async def stream(head, lane: Lane, channel: _Channel, stops, chat, endpoint, with_ids, echo: str | None):
        """Server-sent events: a chunk per accepted batch, the text held back while it could still become a stop string;
        ``echo``: the prompt's text, sent first (with its tokens' log-probabilities) in the first chunk."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        hold = max((len(s) for s in stops), default=1) - 1
        started, task, getter, told = time.perf_counter(), None, None, 0

        def chunk(text: str, ids: list[int], reason: str | None, **extra) -> str:
            nonlocal told, echo  # each token's log-probability goes with the first chunk after it came (text may wait)
            logprobs = lane.logprobs[told:] if lane.rules.logprobs is not None else None
            told += len(logprobs or [])
            if echo is not None:  # the prompt is in by the first chunk: its tokens' log-probabilities too
                text, logprobs, echo = echo + text, echoed(lane, logprobs), None
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": server.logprobs(logprobs, chat)}
            choice |= {"delta": ({"role": "assistant", "content": text} if text or reason is None else {})} if chat else {"text": text}
            if with_ids or server.gen.tokenizer is None:
                choice["token_ids"] = ids
            return json.dumps(head | {"object": kind, "choices": [choice]} | extra)

        try:
            task = server.submit(lane)
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
                if upto > sent or with_ids or server.gen.tokenizer is None or echo is not None:
                    yield chunk(text[sent:upto], new, None)
                    sent = upto
            out = await task
            text, stopped = server.text_of(tokens, stops)
            reason = "stop" if stopped or out.finish_reason == "stop" else "length"
            server.record(endpoint, out, started)
            extra = {"usage": usage(lane.prompt, out), "lookahead": out.stats.as_dict()}
            yield chunk(text[sent:], [], reason, **extra)
            yield "[DONE]"
        finally:  # also when the client went away: the lane leaves the batch at its next step
            lane.cancelled = not lane.finished
            server.pending -= 1
            if getter is not None:
                getter.cancel()
            if task is not None:
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: nothing to log

    return app


def usage(prompt: list[int], out: GenerationResult) -> dict:
    """A response's token counts, as OpenAI's: those of the prompt that came from held keys among them."""
    return {"prompt_tokens": len(prompt), "completion_tokens": len(out.tokens), "total_tokens": len(prompt) + len(out.tokens),
            "prompt_tokens_details": {"cached_tokens": out.stats.reused_tokens}}


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


def serve(gen: LookaheadGenerator, model_name: str, host: str, port: int, state_path: Path | None, queue_limit: int,
          max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None, max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK,
          held_keys: int = HELD_KEYS_BYTES) -> None:
    import uvicorn

    state = gen.load_state(state_path)  # checked against the generator (ValueError)
    gen.grow_prior(state)  # before it listens: no request waits on it
    app = create_app(Server(gen, model_name, state, queue_limit, state_path, max_body_bytes, api_key, max_batch, prefill_chunk, held_keys))
    uvicorn.run(app, host=host, port=port, log_level="info")
