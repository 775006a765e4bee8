"""The OpenAI request bodies ``lookahead serve`` takes, their checks, its errors and its request body limit."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from lookahead.rules import MAX_LOGPROBS, PENALTY_BOUND


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
    presence_penalty: float = Field(default=0.0, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY_BOUND, le=PENALTY_BOUND)
    repetition_penalty: float | None = Field(default=None, gt=0)
    echo: bool = False
    user: str | None = None
    stream_options: dict | None = None
    lookahead: bool = True  # ours: false decodes this request plainly (one token per forward) in the same batch


class CompletionRequest(_Common):
    prompt: Any  # text, token ids, or a list of one of either: checked by ``check_request``
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives with each token's log-probability
    return_token_ids: bool = False


class ChatRequest(_Common):
    messages: list[dict]
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False


IGNORED = {"user", "stream_options"}  # accepted and without effect on the output
NOT_TEXT = "messages must be a non-empty list of {role, content} with text content"


def check_request(req: _Common, chat: bool, model_name: str, tokenizer) -> tuple[Any, dict, list[str]]:
    """(prompt or messages, keyword arguments for ``generate``, stop strings) or an APIError: the cheap checks,
    made on the event loop (tokenising and the checks on token ids are the server's, in its worker thread)."""
    if req.model is not None and req.model != model_name:
        raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}", "model", "model_not_found")
    extra = set(req.model_extra or {}) - IGNORED
    if extra:
        raise APIError(400, f"unsupported parameter(s): {', '.join(sorted(extra))}", sorted(extra)[0])
    for name, ok in (("n", req.n == 1), ("best_of", req.best_of in (None, 1))):
        if not ok:
            raise APIError(400, f"{name}={getattr(req, name)!r} is not supported (one greedy or sampled sequence per request)", name)
    if req.echo and chat:
        raise APIError(400, "echo is for /v1/completions", "echo")
    if chat and req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs
    if chat:
        if tokenizer is None or not tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        if not req.messages:
            raise APIError(400, NOT_TEXT, "messages")
        prompt = [m | {"content": _text(m.get("content"), i)} for i, m in enumerate(req.messages)]
    else:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (send several requests: the server batches them)", "prompt")
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
    options |= {name: value for name, value in (("presence_penalty", req.presence_penalty), ("frequency_penalty", req.frequency_penalty)) if value}
    if logprobs is not None:
        options["logprobs"] = logprobs
        if req.echo:  # the prompt's tokens too, each after those before it (lm-eval-harness's loglikelihood)
            options["prompt_logprobs"] = logprobs
    if stops:
        options["stop_strings"] = stops
    max_tokens = req.max_completion_tokens or req.max_tokens or (None if chat else 16)  # OpenAI's: a chat's, the rest of the context
    return prompt, dict(max_new_tokens=max_tokens, seed=req.seed, lookahead=req.lookahead, **options), stops


def _text(content: Any, index: int) -> str:
    """A message's content as text: a string, or OpenAI's content parts of type "text", joined by newlines (as vLLM
    joins them: clients such as LangChain's send parts even for text alone); any other part is a 400 naming it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(part, dict) for part in content):
        for part in content:
            if part.get("type") != "text":
                raise APIError(400, f"message {index} has a content part of type {part.get('type')!r}: this server takes text alone",
                               "messages")
        if all(isinstance(part.get("text"), str) for part in content):
            return "\n".join(part["text"] for part in content)
    raise APIError(400, NOT_TEXT, "messages")


class BodyLimit:
    """ASGI middleware: reading a request body past ``limit`` bytes, as declared or (chunked) as it arrives, raises
    a 413 that the app answers OpenAI-style (FastAPI's ``max_body_size`` answers a declared one in plain text)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        received = 0

        async def limited_receive():
            nonlocal received
            if declared.isdigit() and int(declared) > self.limit:
                raise HTTPException(413)
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413)
            return message

        await self.app(scope, limited_receive, send)
