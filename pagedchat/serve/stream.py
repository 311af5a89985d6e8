"""A request's n choices seen from the event loop: their updates as an async stream, and cancel-on-disconnect."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request

from pagedchat.backends.base import TokenBackend
from pagedchat.engine.records import Outcome, Update
from pagedchat.engine.params import SamplingParams

T = TypeVar("T")


class ChoiceStream:
    """Submits ids to the backend for n replies; its thread's on_update puts each (choice index, Update) on this
    loop's queue.

    on_finish runs on the loop with each reply's Outcome however it ended, read to the end or not (a client
    that disconnects still counts in the metrics, as cancelled)."""

    def __init__(self, backend: TokenBackend, ids: list[int], params: SamplingParams, request_id: str,
                 on_finish: Callable[[Outcome], None], n: int = 1):
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()
        self._open = n      # replies whose final update the reader has not taken yet
        self._running = n   # replies whose final update has not arrived yet
        index: dict[str, int] = {}

        def arrive(update: Update) -> None:  # on the loop, after every reply's id is known
            self._queue.put_nowait((index[update.request_id], update))
            if update.finished:
                self._running -= 1
                on_finish(update.outcome)

        def on_update(update: Update) -> None:  # on the engine thread
            loop.call_soon_threadsafe(arrive, update)

        self.replies = backend.submit_ids([ids], params, request_ids=[request_id], on_update=on_update, n=n)
        index.update((r.request_id, i) for i, r in enumerate(self.replies))

    async def updates(self):
        """(choice index, Update) until every reply has finished."""
        while self._open:
            i, update = await self._queue.get()
            self._open -= update.finished
            yield i, update

    async def outcomes(self) -> list[Outcome]:
        done: dict[int, Outcome] = {}
        async for i, update in self.updates():
            if update.finished:
                done[i] = update.outcome
        return [done[i] for i in range(len(self.replies))]

    @property
    def running(self) -> int:
        """Replies whose final update has not arrived on the loop yet."""
        return self._running

    def end(self) -> None:
        """Cancel the replies still running and let the reader go on to their final updates, whose finish reason
        says cancelled (a shutdown's drain)."""
        for reply in self.replies:
            reply.cancel()

    def close(self) -> None:
        """Cancel the replies still running: the engine frees their pages at its next step."""
        if self._open:
            self._open = 0
            for reply in self.replies:
                reply.cancel()


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
