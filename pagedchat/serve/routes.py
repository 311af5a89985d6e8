"""The Starlette app: OpenAI's chat and completion endpoints, models, health, metrics and the page map.

The server drives the engine through the backend face (a TokenBackend: LocalBackend over the Engine), never
the Engine itself. Threads: the event loop only parses, formats and forwards. The engine runs every torch call
on its own compute thread; its on_update callbacks hand each step's update to the loop with
call_soon_threadsafe. Tokenizing a prompt (possibly long, and a chat template render) runs on a worker thread,
one at a time; compiling a grammar on another (serve/grammars.py), so that no prompt waits for a schema.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial
from typing import Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pagedchat.backends.base import TokenBackend
from pagedchat.engine.chat_template import prompt_size
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.records import FinishReason, Outcome
from pagedchat.errors import PagedChatError
from pagedchat.serve.grammars import COMPILE_SECONDS, GrammarWorker
from pagedchat.serve.limits import MIN_BODY_BYTES, BodyLimit, LogOnce, PerClientLimit, default_body_limit
from pagedchat.serve.prometheus import ServeMetrics
from pagedchat.serve.prompts import ExchangeMemory, build_chat_prompt
from pagedchat.serve.protocol import ApiError, ChatRequest, CompletionRequest, capped, parse
from pagedchat.serve.responses import SSE_DONE, ChoiceChunks, Kind, ResponseBuilder, sse
from pagedchat.serve.stream import ChoiceStream, until_disconnect

log = logging.getLogger("pagedchat.serve")


class EventStream(StreamingResponse):
    """An SSE response that cancels its engine request however it ends: done, client gone, or server stopping."""

    def __init__(self, content, stream: ChoiceStream):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()


class BearerAuth:
    """ASGI middleware: /v1 paths need `Authorization: Bearer KEY` with one of the server's keys; /health and
    /metrics stay open, as in vLLM. The scheme's name is case-insensitive (RFC 7235), so `bearer KEY` passes too."""

    def __init__(self, app, api_keys: tuple[str, ...]):
        self.app = app
        self.keys = tuple(key.encode() for key in api_keys)

    def _known(self, token: bytes) -> bool:
        # Every key is compared, so the time taken says nothing about which one came close.
        return sum(hmac.compare_digest(token, key) for key in self.keys) > 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if not (scheme.lower() == b"bearer" and self._known(token.lstrip(b" "))):
                error = ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                 code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Server:
    """The state behind the routes: the backend once loaded, the exchange memory, the metrics."""

    def __init__(self, load_backend: Callable[[], TokenBackend], model_name: str,
                 on_load_failure: Callable[[BaseException], None] | None = None, max_body_size: int | None = None,
                 grammar_seconds: float = COMPILE_SECONDS, max_request_tokens: int | None = None):
        self.load_backend = load_backend
        self.max_request_tokens = max_request_tokens
        self.model_name = model_name
        self.on_load_failure = on_load_failure
        self.max_body_size = max_body_size
        self.backend: TokenBackend | None = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self.exchanges = ExchangeMemory()
        self.metrics = ServeMetrics(model_name, lambda: self.backend.memory() if self.backend else None)
        self._tokenizing: anyio.CapacityLimiter | None = None
        self.grammars = GrammarWorker(grammar_seconds)
        self._open: dict[str, ChoiceStream] = {}   # replies not finished yet, by id: what a shutdown ends

    # ---- life cycle: listen first, load the model on a thread, so /health can say "loading" ---------------
    def _load(self) -> None:
        try:
            self.backend = self.load_backend()
            log.info("model %s ready", self.model_name)
        except BaseException as exc:  # reported, and the CLI exits with it
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("could not load the model: %s", self.load_error)
            if self.on_load_failure:
                self.on_load_failure(exc)

    def body_limit(self) -> int:
        """--max-body-size, else a few times the model's context in bytes (a floor until the model is loaded)."""
        if self.max_body_size is not None:
            return self.max_body_size
        return default_body_limit(self.backend.info.context_length) if self.backend else MIN_BODY_BYTES

    def end_replies(self) -> None:
        """End every open reply now, as cancelled: each stream still sends its final chunk and [DONE]."""
        for stream in list(self._open.values()):
            stream.end()

    @asynccontextmanager
    async def lifespan(self, app):
        asyncio.get_running_loop().set_exception_handler(LogOnce())
        threading.Thread(target=self._load, name="pagedchat-load", daemon=True).start()
        yield
        self.grammars.shutdown()
        if self.backend is not None:
            self.backend.shutdown()

    def _ready_backend(self) -> TokenBackend:
        if self.backend is None:
            raise ApiError(503, f"the model failed to load: {self.load_error}" if self.load_error
                           else "the model is still loading; retry when GET /health answers 200",
                           kind="service_unavailable")
        return self.backend

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _off_loop(self, fn, *args):
        """fn on a worker thread, one at a time (tokenizing in parallel only contends for the same cores)."""
        if self._tokenizing is None:
            self._tokenizing = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._tokenizing)

    # ---- the OpenAI endpoints ------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        backend = self._ready_backend()
        req = parse(ChatRequest, await request.body())
        self._check_model(req.model)
        plan = req.output_plan()
        messages, continued = req.template_messages(), req.continue_final_message
        try:
            ids = await self._off_loop(build_chat_prompt, backend, messages, self.exchanges, continued)
        except PagedChatError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        grammar = None
        if plan.grammar is not None:
            try:
                grammar = await self.grammars.compile(backend, plan.grammar)
            except PagedChatError as exc:
                raise ApiError(400, str(exc), param="tools" if plan.calls_tools else "response_format") from None

        def remember(done: Outcome) -> None:
            self.exchanges.remember(messages, continued, done.text, done.history_ids)

        builder = ResponseBuilder.new(Kind.CHAT, f"chatcmpl-{uuid.uuid4().hex}", self.model_name,
                                      _namer(backend, req), plan)
        return await self._respond(request, backend, builder, ids, req, "messages", remember, grammar)

    async def completions(self, request: Request) -> Response:
        backend = self._ready_backend()
        req = parse(CompletionRequest, await request.body())
        self._check_model(req.model)
        try:
            ids = await self._off_loop(partial(backend.prompt_ids, req.prompt_input(),
                                               parse_special=req.parse_special_tokens))
        except PagedChatError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        builder = ResponseBuilder.new(Kind.TEXT, f"cmpl-{uuid.uuid4().hex}", self.model_name, _namer(backend, req))
        return await self._respond(request, backend, builder, ids, req, "prompt", lambda done: None)

    def _params(self, backend: TokenBackend, ids: list[int], req, prompt_field: str, grammar) -> SamplingParams:
        """The request's sampling; max_tokens defaults to all that the context and the cache leave. A context
        overflow is worded as OpenAI's, which litellm maps to its context-window error. Its message also ends
        with the code: openai>=3.60 puts only the message in an error's text, where langchain-openai looks for
        the code."""
        info = backend.info
        context = info.context_length
        if not ids:
            raise ApiError(400, f"the {prompt_field} is empty once tokenized", param=prompt_field)
        if len(ids) >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, your "
                           f"{prompt_field} resulted in {prompt_size(len(ids), context)} tokens "
                           "(context_length_exceeded).",
                           param=prompt_field, code="context_length_exceeded")
        max_tokens = req.requested_max_tokens
        if max_tokens is not None and len(ids) + max_tokens > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_field}, {max_tokens} in the "
                           "completion). Please reduce the length of the messages or completion "
                           "(context_length_exceeded).",
                           param="max_tokens", code="context_length_exceeded")
        cap = self.max_request_tokens
        if cap is not None and max_tokens is not None and req.n * max_tokens > cap:
            raise ApiError(400, f"n x max_tokens is {req.n * max_tokens}, over this server's limit of {cap} tokens a "
                           "request (pagedchat serve --max-request-tokens)", param="max_tokens")
        if max_tokens is None:
            cache_tokens = info.num_pages * info.block_size
            # Where the context is the limit, the engine stops there and says so (context_full); where the
            # cache is the smaller one, the reply may take all of it.
            max_tokens = context if cache_tokens >= context else cache_tokens - len(ids)
            if max_tokens < 1:
                raise ApiError(400, f"the prompt's {len(ids)} tokens fill the KV cache", param=prompt_field)
            if cap is not None:  # unasked, each of the n replies gets its share of the cap
                if req.n > cap:
                    raise ApiError(400, f"n is over this server's limit of {cap} tokens a request "
                                   "(pagedchat serve --max-request-tokens)", param="n")
                max_tokens = min(max_tokens, cap // req.n)
        req.check_token_ids(info.vocab_size)
        try:
            return req.sampling_params(max_tokens, grammar)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    async def _respond(self, request: Request, backend: TokenBackend, builder: ResponseBuilder, ids: list[int], req,
                       prompt_field, on_done: Callable[[Outcome], None], grammar=None) -> Response:
        params = self._params(backend, ids, req, prompt_field, grammar)
        started = time.perf_counter()

        def finished(done: Outcome) -> None:
            if not stream.running:   # the last of its n replies
                self._open.pop(builder.id, None)
            self.metrics.observe(done, len(ids), time.perf_counter() - started)
            if done.finish_reason is not FinishReason.ERROR:
                on_done(done)

        try:
            stream = ChoiceStream(backend, ids, params, builder.id, finished, req.n)
        except PagedChatError as exc:  # e.g. max_tokens more than the cache can ever hold
            raise ApiError(400, str(exc), param="max_tokens") from None
        self._open[builder.id] = stream   # finished() runs on this loop, so never before this line
        if req.stream:
            return EventStream(self._events(builder, stream, len(ids), req), stream)
        try:
            outcomes = await until_disconnect(request, stream.outcomes())
        finally:
            stream.close()
        if outcomes is None:  # the client went away; its requests are cancelled and their pages freed
            return Response(status_code=499)
        failed = next((o for o in outcomes if o.finish_reason is FinishReason.ERROR), None)
        if failed is not None:
            raise ApiError(500, f"generation failed: {failed.error}", kind="server_error")
        return JSONResponse(builder.whole(len(ids), outcomes))

    async def _events(self, builder: ResponseBuilder, stream: ChoiceStream, prompt_tokens: int, req):
        chunks = ChoiceChunks(builder, req.n, req.include_usage)
        for chunk in chunks.opening():
            yield chunk
        async for i, update in stream.updates():
            if update.finished and update.outcome.finish_reason is FinishReason.ERROR:
                yield sse(ApiError(500, f"generation failed: {update.outcome.error}", kind="server_error").body())
                break
            for chunk in chunks.feed(i, update):
                yield chunk
        else:
            for chunk in chunks.closing(prompt_tokens):
                yield chunk
        yield SSE_DONE

    # ---- the rest ------------------------------------------------------------------------------------------
    def _card(self) -> dict:
        info = self._ready_backend().info
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pagedchat",
                "root": info.model, "max_model_len": info.context_length}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        card = self._card()
        self._check_model(request.path_params["model_id"])
        return JSONResponse(card)

    async def health(self, request: Request) -> Response:
        if self.backend is not None:
            return JSONResponse({"status": "ok"})
        status = "failed" if self.load_error else "loading"
        error = capped(self.load_error) if self.load_error else None
        return JSONResponse({"status": status, "error": error}, status_code=503)

    async def memory(self, request: Request) -> Response:
        backend = self._ready_backend()
        snap = await anyio.to_thread.run_sync(backend.memory)
        return JSONResponse({"model": self.model_name, "snapshot": snap.to_json()})

    async def prometheus(self, request: Request) -> Response:
        text = await anyio.to_thread.run_sync(self.metrics.render)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _namer(backend: TokenBackend, req) -> Callable[[list[int]], list[str]]:
    """How log-probabilities name tokens: by their text, or as "token_id:N" where the request asks (vLLM's
    return_tokens_as_token_ids, for a client that needs the ids)."""
    if req.return_tokens_as_token_ids:
        return lambda ids: [f"token_id:{i}" for i in ids]
    return backend.token_texts


async def _api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = (f"no such endpoint: {request.method} {request.url.path}" if exc.status_code == 404
               else f"{request.method} is not allowed on {request.url.path}" if exc.status_code == 405
               else str(exc.detail))
    error = ApiError(exc.status_code, message)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("request failed", exc_info=exc)
    error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
    return JSONResponse(error.body(), status_code=500)


def create_app(load_backend: Callable[[], TokenBackend], model_name: str, *, api_keys: tuple[str, ...] = (),
               on_load_failure: Callable[[BaseException], None] | None = None, max_body_size: int | None = None,
               grammar_seconds: float = COMPILE_SECONDS, max_requests_per_key: int | None = None,
               max_request_tokens: int | None = None) -> Starlette:
    """The app; app.state.server is its Server (the CLI ends its replies on shutdown)."""
    server = Server(load_backend, model_name, on_load_failure, max_body_size, grammar_seconds, max_request_tokens)
    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        Route("/v1/memory", server.memory, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ]
    # The key is checked before the body is counted: a client without it is refused before it sends much.
    middleware = [Middleware(BearerAuth, api_keys=api_keys)] if api_keys else []
    if max_requests_per_key is not None:
        middleware.append(Middleware(PerClientLimit, most=max_requests_per_key))
    middleware.append(Middleware(BodyLimit, limit=server.body_limit))
    app = Starlette(routes=routes, middleware=middleware, lifespan=server.lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, 500: _server_error})
    app.state.server = server
    return app
