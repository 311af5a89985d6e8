"""Any OpenAI-compatible server behind the backend face: vLLM (one model over several GPUs), llama-server,
`pagedchat serve`.

Streaming uses the official `openai` client: it is the reference for the API, parses the SSE stream and its
`[DONE]`, and types chunks and errors (status codes included). Its requests run on one asyncio loop on a thread
of this backend's own, so any number of replies stream at once and none ever blocks the UI; stopping a reply
cancels its task, which closes the HTTP stream, and the server cancels the request when its client goes.
The two non-OpenAI endpoints (`/v1/memory` from `pagedchat serve`, Prometheus `/metrics` from vLLM) are plain
GETs with httpx, polled in the background: memory() returns the latest picture without waiting.

Forking a live reply sends the conversation with the reply so far as a final assistant message and
`continue_final_message` (vLLM's and pagedchat serve's extra field). A server that refuses it (400) is asked
again without the partial reply: the branch then answers afresh, and its first update says so.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import replace
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

from pagedchat.backends.base import BackendInfo, MemoryUnavailable, MemoryView, OnUpdate
from pagedchat.backends.remote_metrics import ServerMetrics, parse_metrics
from pagedchat.config import API_KEY_ENV
from pagedchat.engine.kv_snapshot import MemorySnapshot
from pagedchat.engine.params import SAMPLING_FIELDS
from pagedchat.engine.records import FinishReason, Outcome, Update
from pagedchat.errors import PagedChatError

CONNECT_S = 5.0        # a server that does not accept a connection in this time is reported as down
READ_S = 600.0         # between two chunks: a queued request may wait long for its first token
REFRESH_S = 0.25       # the inspector's page map is at most this old (plus one round trip)
METRICS_REFRESH_S = 1.0  # /metrics: server-wide totals, a larger page that every client would poll
LOADING_S = 600.0      # how long to wait for a server that answers 503 while it loads its model
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
# Wire words that are not FinishReason's own: vLLM's (and pagedchat serve's) for a cancelled request, and
# OpenAI's older word for a tool call.
FINISH_REASONS = {"abort": FinishReason.CANCELLED, "function_call": FinishReason.TOOL_CALLS}


def finish_reason_of(word: str, stop_reason: object = None) -> FinishReason:
    """A chunk's finish_reason, with vLLM's stop_reason extra, which tells the context limit from max_tokens."""
    if stop_reason == "context_full":
        return FinishReason.CONTEXT_FULL
    return FINISH_REASONS.get(word) or FinishReason.read(word)


class ServerUnavailable(PagedChatError):
    """The server cannot be reached or refuses us."""


def api_base(url: str) -> str:
    """The OpenAI base URL: `http://host:8000` means `http://host:8000/v1`; a path given is kept."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ServerUnavailable(f"--server {url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def server_root(base: str) -> str:
    """Where /metrics lives: vLLM serves it beside /v1, not under it."""
    return base[:-len("/v1")] if base.endswith("/v1") else base


def _reason(exc: BaseException) -> str:
    """A short cause for a network error: the innermost exception's message."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return str(exc).strip() or type(exc).__name__


def _rekey(snap: MemorySnapshot, names: dict[str, str]) -> MemorySnapshot:
    """The server's request ids replaced by this backend's, so that pages are owned by the app's handles."""
    if not names:
        return snap
    n = lambda rid: names.get(rid, rid)  # noqa: E731
    return replace(snap, seqs={n(r): replace(s, request_id=n(r)) for r, s in snap.seqs.items()},
                   shared_pages={p: [n(r) for r in ids] for p, ids in snap.shared_pages.items()})


class RemoteHandle:
    """One streamed chat completion. Its fields change on the backend's loop thread only."""

    def __init__(self, backend: "RemoteBackend", request_id: str, messages: list[dict], params,
                 on_update: OnUpdate | None, prefill: str = "", inherited: str | None = None) -> None:
        self._backend = backend
        self.request_id = request_id
        self.messages = messages            # the conversation, ending with the user's message
        self.prefill = prefill              # assistant text this request continues (a fork), else ""
        self.params = params
        self._on_update = on_update
        self._inherited = inherited
        self.server_id: str | None = None   # the response id: the server engine's request id
        self.text = ""
        self.tokens = 0
        self.usage = None
        self.finish_reason: FinishReason | None = None
        self.pages: tuple[int, ...] = ()    # its block table as last seen in /v1/memory
        self.started = time.perf_counter()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self._future = None
        self._outcome: Outcome | None = None
        self._done = threading.Event()

    # ---- what the app calls ----
    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()

    def so_far(self) -> Outcome:
        return self._figures(None, None)

    def result(self, timeout: float | None = None) -> Outcome:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} still running after {timeout}s")
        return self._outcome

    # ---- on the loop thread ----
    def request(self, *, prefill: bool) -> dict:
        p = self.params
        messages = self.messages + ([{"role": "assistant", "content": self.prefill}] if prefill else [])
        extra = dict(CONTINUE) if prefill else {}
        args = dict(model=self._backend.model, messages=messages, stream=True,
                    stream_options={"include_usage": True})
        for f in SAMPLING_FIELDS:
            value = getattr(p, f.name)
            if f.openai and value is not None:
                args[f.name] = value
            elif not f.openai and value != f.default:
                # vLLM's and llama-server's, not OpenAI's: sent only when set, so a strict server still takes
                # a chat that leaves them alone
                extra[f.name] = value
        if p.stop:
            args["stop"] = list(p.stop)
        if extra:
            args["extra_body"] = extra
        return args

    def take(self, chunk) -> None:
        if self.server_id is None and chunk.id:
            self.server_id = chunk.id
            self._backend.by_server[chunk.id] = self
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:
            text = (choice.delta.content or "") if choice.delta else ""
            if choice.finish_reason:
                extra = choice.model_extra or {}
                self.finish_reason = finish_reason_of(choice.finish_reason, extra.get("stop_reason"))
            if text:
                now = time.perf_counter()
                self.first_at = self.first_at or now
                self.last_at = now
                self.text += text
                self.tokens += 1   # a chunk per token is what servers send; the usage chunk corrects the count
                self._emit(Update(self.request_id, text, 1))

    def _emit(self, update: Update) -> None:
        if self._inherited is not None:
            update, self._inherited = replace(update, inherited=self._inherited), None
        if self._on_update is not None:
            self._on_update(update)

    def restart_fresh(self) -> None:
        """The fork fallback: no partial reply to continue, so the branch answers the question afresh."""
        self.prefill, self._inherited = "", ""
        self._emit(Update(self.request_id, "", notices=("This server cannot continue a partial reply, so the "
                                                        "branch answers the question afresh.",)))

    def _figures(self, reason: FinishReason | None, error: str | None) -> Outcome:
        usage = self.usage
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        tps = None
        if self.first_at and self.last_at and self.last_at > self.first_at and self.tokens > 1:
            tps = (self.tokens - 1) / (self.last_at - self.first_at)
        return Outcome(self.request_id, self.text, reason,
                       prompt_tokens=(usage.prompt_tokens or 0) if usage else 0,
                       cached_tokens=(getattr(details, "cached_tokens", 0) or 0) if details else 0,
                       generated_tokens=(usage.completion_tokens or self.tokens) if usage else self.tokens,
                       time_to_first_token=(self.first_at - self.started) if self.first_at else None,
                       decode_tokens_per_s=tps, error=error, pages=self.pages, counted=usage is not None)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self._outcome = self._figures(reason, error)
        self._backend.by_server.pop(self.server_id, None)
        self._done.set()
        self._emit(Update(self.request_id, "", outcome=self._outcome))


class RemoteBackend:
    """An OpenAI-compatible server. Construct it off the UI thread: it connects and asks for the model."""

    failure = None   # a server that fails, fails requests: each says why, and the next one tries again
    core_loan = None   # its engine computes elsewhere

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 progress: Callable[[str, float | None], None] | None = None) -> None:
        self.base = api_base(url)
        self._progress = progress or (lambda stage, fraction: None)
        self.root = server_root(self.base)
        self._api_key = api_key
        self._ids = itertools.count()
        self.by_server: dict[str, RemoteHandle] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagedchat-remote", daemon=True)
        self._thread.start()
        self._view: MemoryView = MemoryUnavailable("asking the server…")
        self._refreshing = False
        self._refreshed = 0.0
        try:
            self._call(self._open())
            self.model, context = self._call(self._model(model), timeout=LOADING_S + CONNECT_S * 3)
            self._memory_url, self._view = self._call(self._probe_memory())
        except BaseException:
            self.shutdown()
            raise
        self.info = self._describe(context)

    # ---- the face ----
    def submit(self, messages: list[dict], params, *, previous: Outcome | None = None,
               on_update: OnUpdate | None = None) -> RemoteHandle:
        # `previous` goes unused: the server keeps its own prefix cache and re-renders the template itself.
        reply = RemoteHandle(self, f"remote-{next(self._ids)}", list(messages), params, on_update)
        reply._future = asyncio.run_coroutine_threadsafe(self._stream(reply, fork=False), self._loop)
        return reply

    def prompt_tokens(self, messages: list[dict], previous: Outcome | None = None) -> None:
        # The server's tokenizer and template are not ours to run: its own 400 says when a prompt is too long.
        return None

    def fork(self, parent: RemoteHandle, params, *, on_update: OnUpdate | None = None) -> RemoteHandle:
        # Read on the UI thread while the parent streams: a str is swapped whole, so this is one consistent value.
        text = parent.text
        reply = RemoteHandle(self, f"remote-{next(self._ids)}", parent.messages, params, on_update,
                            prefill=parent.prefill + text, inherited=text)
        reply._future = asyncio.run_coroutine_threadsafe(self._stream(reply, fork=True), self._loop)
        return reply

    def memory(self) -> MemoryView:
        now = time.monotonic()
        every = METRICS_REFRESH_S if isinstance(self._view, ServerMetrics) else REFRESH_S
        if not self._refreshing and now - self._refreshed >= every and self._loop.is_running():
            self._refreshing = True
            asyncio.run_coroutine_threadsafe(self._refresh(), self._loop)
        return self._view

    def stalled_for(self) -> None:
        return None   # a server sends nothing between chunks to tell a busy one from one that stopped

    def shutdown(self) -> None:
        if not self._loop.is_running():
            return
        try:
            self._call(self._close(), timeout=3.0)
        except Exception:  # closing a dead connection: nothing left to save
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=3.0)

    # ---- on the loop thread ----
    def _call(self, coro, timeout: float = CONNECT_S * 3):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open(self) -> None:
        import httpx
        import openai
        from openai import AsyncOpenAI

        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(CONNECT_S))
        # "EMPTY": the client insists on a key, and servers without --api-key ignore the header (vLLM's own advice).
        self._client = AsyncOpenAI(base_url=self.base, api_key=self._api_key or "EMPTY", max_retries=0,
                                   timeout=openai.Timeout(READ_S, connect=CONNECT_S))

    async def _close(self) -> None:
        tasks = asyncio.all_tasks(self._loop) - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.close()
        await self._http.aclose()
        # A stream's chunk iterator left by a reply that ended is closed by a task the loop would never run once
        # stopped ("Task was destroyed but it is pending!" at exit): close them all while it still runs.
        await self._loop.shutdown_asyncgens()

    async def _get(self, url: str):
        import httpx

        try:
            response = await self._http.get(url)
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"Cannot reach the server at {self.base} ({_reason(exc)}).") from exc
        if response.status_code in (401, 403):
            raise ServerUnavailable(f"The server at {self.base} refused the API key ({response.status_code}): "
                                    f"pass --api-key or set {API_KEY_ENV}.")
        return response

    async def _model(self, wanted: str | None) -> tuple[str, int | None]:
        deadline = time.monotonic() + LOADING_S
        response = await self._get(self.base + "/models")
        while response.status_code == 503 and time.monotonic() < deadline:  # vLLM and pagedchat serve, loading
            self._progress(f"{self.base} is loading its model", None)
            await asyncio.sleep(0.5)
            response = await self._get(self.base + "/models")
        try:
            response.raise_for_status()
            models = response.json()["data"]
        except Exception as exc:
            raise ServerUnavailable(f"{self.base}/models did not list models ({_reason(exc)}): "
                                    "is this an OpenAI-compatible server?") from exc
        if not models:
            raise ServerUnavailable(f"The server at {self.base} serves no model.")
        entry = next((m for m in models if m.get("id") == wanted), None) if wanted else models[0]
        if entry is None:
            names = ", ".join(m.get("id", "?") for m in models)
            raise ServerUnavailable(f"The server at {self.base} has no model {wanted!r} (it serves {names}).")
        return entry["id"], entry.get("max_model_len")

    async def _probe_memory(self) -> tuple[str | None, MemoryView]:
        """Which memory picture this server gives: /v1/memory, else /metrics in vLLM's names, else none."""
        for url in (self.base + "/memory", self.root + "/metrics"):
            view = await self._read_memory(url)
            if not isinstance(view, MemoryUnavailable):
                return url, view
        return None, MemoryUnavailable(f"{self.base} serves neither /v1/memory nor vLLM's /metrics: "
                                       "there is no memory picture to show.")

    async def _read_memory(self, url: str) -> MemoryView:
        try:
            response = await self._get(url)
            if response.status_code != 200:
                return MemoryUnavailable(f"{url} answered {response.status_code}")
            if url.endswith("/memory"):
                return _rekey(MemorySnapshot.from_json(response.json()["snapshot"]),
                              {sid: r.request_id for sid, r in self.by_server.items()})
            return parse_metrics(response.text) or MemoryUnavailable(f"{url} has no KV-cache metrics")
        except ServerUnavailable as exc:
            return MemoryUnavailable(str(exc))
        except Exception as exc:  # a body in another shape than we read
            return MemoryUnavailable(f"{url} sent what we cannot read ({_reason(exc)})")

    async def _refresh(self) -> None:
        try:
            if self._memory_url is None:
                return
            view = await self._read_memory(self._memory_url)
            if isinstance(view, MemorySnapshot):
                for reply in self.by_server.values():
                    seq = view.seqs.get(reply.request_id)
                    if seq is not None and seq.pages:
                        reply.pages = tuple(seq.pages)
            self._view = view
        finally:
            self._refreshed = time.monotonic()
            self._refreshing = False

    async def _stream(self, reply: RemoteHandle, fork: bool) -> None:
        import openai

        try:
            try:
                await self._read(reply, prefill=fork)
            except openai.BadRequestError:
                if not fork or reply.text:
                    raise
                reply.restart_fresh()
                await self._read(reply, prefill=False)
        except asyncio.CancelledError:
            reply.finish(FinishReason.CANCELLED)
        except openai.APIStatusError as exc:
            reply.finish(FinishReason.ERROR, f"the server answered {exc.status_code}: {_status_message(exc)}")
        except _transport_errors() as exc:
            where = "went away mid-reply" if reply.text else "could not be reached"
            reply.finish(FinishReason.ERROR, f"the server at {self.base} {where} ({_reason(exc)})")
        except Exception as exc:  # anything else ends this reply only, with its text kept
            reply.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        else:
            reply.finish(reply.finish_reason or FinishReason.STOP)

    async def _read(self, reply: RemoteHandle, prefill: bool) -> None:
        stream = await self._client.chat.completions.create(**reply.request(prefill=prefill))
        async with stream:
            async for chunk in stream:
                reply.take(chunk)

    def _describe(self, context: int | None) -> BackendInfo:
        view = self._view
        block = getattr(view, "block_size", None)
        pages = view.num_pages if isinstance(view, MemorySnapshot) else getattr(view, "num_pages", None)
        page_bytes = view.page_bytes if isinstance(view, MemorySnapshot) else None
        return BackendInfo(model=self.model, where=f"via {self.base}", context_length=context, block_size=block,
                           num_pages=pages, page_bytes=page_bytes)


def _status_message(exc) -> str:
    """The message of an OpenAI-shaped error body ({"error": {"message", ...}}), else the exception's text."""
    body = exc.body if isinstance(exc.body, dict) else {}
    return str(body.get("message") or exc.message)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """A connection that fails or breaks mid-stream: the client wraps the first kind and lets the second
    through as its transport's own error (httpx, or httpx2 in openai releases built on that fork)."""
    import httpx
    import openai

    errors: list[type[BaseException]] = [openai.APIConnectionError, httpx.HTTPError]
    try:
        import httpx2
        errors.append(httpx2.HTTPError)
    except ImportError:
        pass
    return tuple(errors)
