"""One reply seen from the event loop: its updates as an async stream, and cancel-on-disconnect."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request

from pagedchat.backends.base import Outcome, TokenBackend, Update
from pagedchat.engine.params import SamplingParams

T = TypeVar("T")


class ReplyStream:
    """Submits ids to the backend; its thread's on_update puts each Update on this loop's queue.

    on_finish runs on the loop with the reply's Outcome however it ended, read to the end or not (a client
    that disconnects still counts in the metrics, as cancelled)."""

    def __init__(self, backend: TokenBackend, ids: list[int], params: SamplingParams, request_id: str,
                 on_finish: Callable[[Outcome], None]):
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._finished = False

        def arrive(update: Update) -> None:  # on the loop
            self._queue.put_nowait(update)
            if update.finished:
                on_finish(update.outcome)

        def on_update(update: Update) -> None:  # on the engine thread
            loop.call_soon_threadsafe(arrive, update)

        [self.reply] = backend.submit_ids([ids], params, request_ids=[request_id], on_update=on_update)

    async def updates(self):
        while not self._finished:
            update = await self._queue.get()
            self._finished = update.finished
            yield update

    async def outcome(self) -> Outcome:
        async for update in self.updates():
            if update.finished:
                return update.outcome
        raise RuntimeError("the stream ended without an outcome")

    def end(self) -> None:
        """Cancel the reply and let its reader go on to the final update, whose finish reason says cancelled."""
        if not self._finished:
            self.reply.cancel()

    def close(self) -> None:
        """Cancel the reply unless it finished: the engine frees its pages at its next step."""
        if not self._finished:
            self._finished = True
            self.reply.cancel()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None as soon as the client disconnects (work is then cancelled)."""
    result: list[T] = []
    async with anyio.create_task_group() as group:
        async def run() -> None:
            result.append(await work)
            group.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(run)
        group.start_soon(watch)
    return result[0] if result else None
