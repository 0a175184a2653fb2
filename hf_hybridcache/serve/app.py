"""The FastAPI app: OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE streams), ``/v1/models``,
``/metrics``, and what gateways read (``/health``, ``/readiness``, ``/liveness``, ``/server_info``, ``/model_info``,
``/v1/loads``: :mod:`~hf_hybridcache.serve.health`). Request and response bodies follow OpenAI's API as ``transformers
serve`` does (its responses are the ``openai`` package's types); errors are OpenAI's JSON errors, 4xx for the client's
mistakes and 500 for the one request that failed inside."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_usage import PromptTokensDetails
from starlette.exceptions import HTTPException

from .backends import Sampling
from .chat_fields import refuse_unsupported_chat
from .choices import ChoiceRunner, Job, Piece, choice_offsets
from .completions import CompletionPayloads, prompts_of, refuse_unsupported
from .health import add_worker_routes
from .image_chat import refuse_images
from .logprobs import TokenTexts, chat_logprobs
from .metrics import ServerMetrics
from .prompts import chat_prompt_ids
from .reply_tier import reply_memory
from .schema import APIError, ChatRequest, CompletionRequest
from .speculation import request_speculative_tokens
from .structured import Grammars, structure_of

#: The header that names the tenant (its prefixes are reused only by its own requests); OpenAI's ``user`` otherwise.
SALT_HEADER = "x-tenant-id"
#: A text completion's ``max_tokens`` when it sends none (OpenAI's default), capped by the room left.
COMPLETION_MAX_TOKENS = 16


def build_app(backend, tokenizer, model_id: str, cache=None, default_max_tokens: int = 256, vision=None) -> FastAPI:
    """The app serving ``backend`` (an :class:`~hf_hybridcache.serve.backends.EngineBackend` or
    :class:`~hf_hybridcache.serve.backends.SequentialBackend`, started and stopped with the app).

    Args:
        tokenizer: the model's tokenizer, with a chat template for ``/v1/chat/completions``.
        model_id: the one model name requests must ask for.
        cache: the :class:`~hf_hybridcache.HybridPrefixCache` behind ``backend`` (its stats go to ``/metrics``).
        default_max_tokens: a chat request's ``max_tokens`` when it sends none (capped by the room left).
        vision: the :class:`~hf_hybridcache.serve.image_chat.ImageChat` of a vision-language wrapper (its processor
            renders every chat), or None: the model takes text only, and image parts are a 400.

    Raises:
        ValueError: ``default_max_tokens`` is not a positive int.
    """
    if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be a positive int (a chat reply's max_tokens when a request sends "
                         f"none), got {default_max_tokens!r}.")
    eos = tokenizer.eos_token_id
    metrics = ServerMetrics(backend, cache)
    runner = ChoiceRunner(backend, tokenizer, metrics, reply_memory(cache), [] if eos is None else [eos])
    texts = TokenTexts(tokenizer)
    grammars = Grammars(tokenizer, backend.vocab_size, [] if eos is None else [eos])

    @contextlib.asynccontextmanager
    async def lifespan(app):
        backend.start()
        try:
            yield
        finally:
            backend.stop()

    app = FastAPI(title="hf_hybridcache", lifespan=lifespan)
    app.state.metrics, app.state.backend = metrics, backend

    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request, problem: APIError):
        return JSONResponse(problem.body(), status_code=problem.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, problem: RequestValidationError):
        errors = problem.errors()  # a union (a message's content) reports each branch: skip the string one
        first = next((e for e in errors if tuple(e.get("loc", ()))[-1:] != ("str",)), errors[0])
        where = ".".join(str(p) for p in first.get("loc", ())[1:] if "[" not in str(p)) or None
        if first.get("type") == "json_invalid":  # loc names a character offset, not a field
            message, where = f"The body is not valid JSON ({first.get('msg')}); send a JSON object.", None
        elif tuple(first.get("loc", ())) == ("body",):
            message = "The body must be a JSON object (OpenAI's request body)."
        else:
            message = f"Invalid request: {where or 'body'}: {first.get('msg')}."
        return JSONResponse(APIError(400, message, param=where).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request, problem: HTTPException):
        return JSONResponse(APIError(problem.status_code, str(problem.detail)).body(), status_code=problem.status_code)

    @app.exception_handler(Exception)
    async def internal(request, problem: Exception):
        return JSONResponse(APIError(500, f"Internal error: {type(problem).__name__}: {problem}").body(),
                            status_code=500)

    def job_for(body, prompt_ids: list[int], request: Request, max_tokens: int | None, default: int,
                remember: bool, logprobs: int | None = None, prompt_logprobs: int | None = None, grammar=None) -> Job:
        """The request's job; ``max_tokens`` None (the client sent none): ``default`` capped by the room left."""
        if body.model != model_id:
            raise APIError(404, f"The model {body.model!r} does not exist; this server serves {model_id!r}.",
                           param="model", code="model_not_found")
        if logprobs is not None and not backend.scores:
            raise APIError(400, "This server runs without the engine (--no-cache) and returns no logprobs; drop "
                           "logprobs or serve with the engine.", param="logprobs")
        max_tokens = reply_tokens(len(prompt_ids), max_tokens, default, backend.max_request_tokens,
                                  "messages" if remember else "prompt")
        salt = request.headers.get(SALT_HEADER) or body.user
        drafts = request_speculative_tokens(body.num_speculative_tokens, backend.num_speculative_tokens)
        sampling = Sampling(max_tokens, body.temperature, body.top_p, body.seed, logprobs, prompt_logprobs, grammar,
                            drafts)
        metrics.prompt_tokens.inc(len(prompt_ids))
        return Job(prompt_ids, sampling, body.stop_strings(), salt, body.n, remember)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        refuse_unsupported_chat(body)
        structure = await structure_of(body, grammars)  # response_format, tools, tool_choice
        salt = request.headers.get(SALT_HEADER) or body.user
        prompt_ids, images, images_key = await chat_prompt(body, salt, structure.template_kwargs)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true.", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        job = job_for(body, prompt_ids, request, max_tokens, default_max_tokens, remember=True, logprobs=logprobs,
                      grammar=structure.grammar)
        job = replace(job, images=images, images_key=images_key)
        return await respond([job], body, structure.payloads(chat_payloads(body.model, logprobs, texts)), request)

    async def chat_prompt(body: ChatRequest, salt: str | None, template_kwargs: dict):
        """A chat's prompt ids, image inputs (None: a text prompt) and images key (the reply memory's)."""
        if vision is not None:
            return await vision.prompt(body.messages, runner.memory, salt, template_kwargs)
        refuse_images(body.messages, model_id)
        messages = [m.for_template() for m in body.messages]
        try:
            return chat_prompt_ids(tokenizer, messages, runner.memory, salt, **template_kwargs), None, b""
        except Exception as problem:  # a template that refuses the conversation (roles out of order, say)
            raise APIError(400, f"The chat template cannot render these messages: {problem}", param="messages")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        refuse_unsupported(body)
        prompts = prompts_of(body, tokenizer, backend.vocab_size)
        if vision is not None:
            vision.refuse_placeholders([ids for ids, _ in prompts])
        scored = body.logprobs if body.echo else None
        jobs = [job_for(body, ids, request, body.max_tokens, COMPLETION_MAX_TOKENS, False, body.logprobs, scored)
                for ids, _ in prompts]
        payloads = CompletionPayloads(body.model, prompts, body.n, body.echo, body.logprobs, texts)
        return await respond(jobs, body, payloads, request)

    async def respond(jobs: list[Job], body, payloads, request: Request):
        arrived = time.perf_counter()
        request_id = f"{'chatcmpl' if isinstance(body, ChatRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        pieces = runner.pieces(jobs, arrived)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(sse(pieces, jobs, payloads, request_id, include_usage),
                                     media_type="text/event-stream")
        collecting = asyncio.ensure_future(collect(pieces, sum(job.n for job in jobs)))
        watching = asyncio.ensure_future(disconnected(request))
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        if not collecting.done():  # the client went away: its choices are cancelled and free their places
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
            return Response(status_code=499)
        choices = collecting.result()
        finals = [pieces[-1] for pieces in choices]
        metrics.hit_tokens.inc(sum(finals[start].hit_tokens for start in choice_offsets(jobs)))
        return JSONResponse(_dump(payloads.whole(request_id, choices, usage(jobs, finals))))

    async def collect(pieces: AsyncIterator[Piece], n: int) -> list[list[Piece]]:
        """The pieces of each of the ``n`` choices, the last one with its finish reason."""
        choices: list[list[Piece]] = [[] for _ in range(n)]
        try:
            async for piece in pieces:
                choices[piece.index].append(piece)
        finally:
            await pieces.aclose()  # cancelled: the choices still running are cancelled with it
        return choices

    async def disconnected(request: Request) -> None:
        """Returns once the client of a non-streaming request has gone away (polled every 0.2 s)."""
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)

    async def sse(pieces: AsyncIterator[Piece], jobs: list[Job], payloads, request_id: str, include_usage: bool):
        finals, firsts = [None] * sum(job.n for job in jobs), set(choice_offsets(jobs))
        try:
            for index in range(len(finals)):
                first = payloads.opening(request_id, index)
                if first is not None:
                    yield _event(first)
            async for piece in pieces:
                if piece.finish_reason is not None:
                    finals[piece.index] = piece
                    if piece.index in firsts:
                        metrics.hit_tokens.inc(piece.hit_tokens)
                yield _event(payloads.chunk(request_id, piece))
            if include_usage:
                yield _event(payloads.usage_chunk(request_id, usage(jobs, finals)))
        except APIError as problem:
            yield f"data: {json.dumps(problem.body())}\n\n"
        yield "data: [DONE]\n\n"

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [Model(id=model_id, created=0, object="model",
                                                 owned_by="hf_hybridcache").model_dump()]}

    add_worker_routes(app, backend, model_id, cache, tokenizer)  # probes, server/model info, loads

    @app.get("/metrics")
    async def scrape():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def reply_tokens(prompt_tokens: int, max_tokens: int | None, default: int, limit: int, param: str) -> int:
    """The tokens a reply may take: ``max_tokens`` as sent, or (None: the client sent none) ``default`` capped by the
    room the prompt leaves within ``limit`` (prompt + reply tokens of one request).

    Raises:
        APIError: 400 ``context_length_exceeded`` when the prompt leaves no room for one token, or the ``max_tokens``
            sent does not fit in the room left (a limit the server computes is never passed on as 0 or less).
    """
    room = limit - prompt_tokens
    if room < 1:
        raise APIError(400, f"The prompt ({prompt_tokens} tokens) leaves no room for a reply within the limit of "
                       f"{limit} tokens per request (prompt and reply together); shorten the prompt.",
                       param=param, code="context_length_exceeded")
    if max_tokens is None:
        return min(default, room)
    if max_tokens > room:
        raise APIError(400, f"The prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is over the limit "
                       f"of {limit} tokens per request; shorten the prompt or lower max_tokens.",
                       param=param, code="context_length_exceeded")
    return max_tokens


def usage(jobs: list[Job], finals: list[Piece | None]) -> CompletionUsage:
    """Prompt tokens of every prompt, completion tokens of every choice, and as ``cached_tokens`` the prompt tokens
    each prompt's first choice restored (with their logprobs, for a request that scores its prompt)."""
    completion = sum(p.completion_tokens for p in finals if p is not None)
    hit = sum(finals[start].hit_tokens for start in choice_offsets(jobs) if finals[start] is not None)
    prompt = sum(len(job.prompt_ids) for job in jobs)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=hit))


def _dump(payload) -> dict:
    return payload if isinstance(payload, dict) else payload.model_dump(mode="json", exclude_none=True)


def _event(payload) -> str:
    return f"data: {json.dumps(_dump(payload))}\n\n"


class chat_payloads:  # noqa: N801 - a namespace of the chat endpoint's payload builders
    def __init__(self, model: str, logprobs: int | None = None, texts: TokenTexts | None = None) -> None:
        self.model, self.created, self.logprobs, self.texts = model, int(time.time()), logprobs, texts

    def whole(self, request_id, choices: list[list[Piece]], usage) -> ChatCompletion:
        out = [{"index": i, "message": {"role": "assistant", "content": "".join(p.text for p in pieces)},
                "finish_reason": pieces[-1].finish_reason, **self._logprobs(pieces)}
               for i, pieces in enumerate(choices)]
        return ChatCompletion(id=request_id, object="chat.completion", created=self.created, model=self.model,
                              choices=out, usage=usage)

    def opening(self, request_id, index) -> ChatCompletionChunk:
        return self._chunk(request_id, [{"index": index, "delta": {"role": "assistant", "content": ""}}])

    def chunk(self, request_id, piece: Piece) -> ChatCompletionChunk:
        delta = {"content": piece.text} if piece.text else {}
        return self._chunk(request_id, [{"index": piece.index, "delta": delta,
                                         "finish_reason": piece.finish_reason, **self._logprobs([piece])}])

    def usage_chunk(self, request_id, usage) -> ChatCompletionChunk:
        return self._chunk(request_id, [], usage=usage)

    def _logprobs(self, pieces: list[Piece]) -> dict:
        """``{"logprobs": ...}`` of ``pieces``' tokens in OpenAI's chat shape when asked, else nothing."""
        if self.logprobs is None:
            return {}
        ids = [i for p in pieces for i in p.token_ids]
        content = chat_logprobs(self.texts, ids, [s for p in pieces for s in p.scores or ()], self.logprobs)
        return {"logprobs": {"content": content, "refusal": None}}

    def _chunk(self, request_id, choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=self.created,
                                   model=self.model, choices=choices, usage=usage)


class _CountRequests:
    """ASGI middleware counting requests by path and status. Plain ASGI, not ``@app.middleware("http")``: Starlette's
    ``BaseHTTPMiddleware`` wraps the receive channel, and a handler behind it never sees its client disconnect."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if status:
                self.metrics.requests.labels(scope["path"], str(status[0])).inc()
