"""One engine request seen from the event loop: its deltas as an async stream, and cancel-on-disconnect."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

import anyio
from starlette.requests import Request

from pagedchat.engine.engine import Engine
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.sequence import Completion, StreamDelta

T = TypeVar("T")


class EngineStream:
    """Submits ids to the engine; the engine thread's on_update puts each delta on this loop's queue.

    on_finish runs on the loop with the request's Completion however it ended, read to the end or not (a
    client that disconnects still counts in the metrics, as cancelled)."""

    def __init__(self, engine: Engine, ids: list[int], params: SamplingParams, request_id: str,
                 on_finish: Callable[[Completion], None]):
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self._finished = False

        def arrive(delta: StreamDelta) -> None:  # on the loop
            self._queue.put_nowait(delta)
            if delta.finished:
                on_finish(delta.completion)

        def on_update(delta: StreamDelta) -> None:  # on the engine thread
            loop.call_soon_threadsafe(arrive, delta)

        self.handle = engine.submit(ids, params, on_update=on_update, request_id=request_id)

    async def deltas(self):
        while not self._finished:
            delta = await self._queue.get()
            self._finished = delta.finished
            yield delta

    async def completion(self) -> Completion:
        async for delta in self.deltas():
            if delta.finished:
                return delta.completion
        raise RuntimeError("the stream ended without a completion")

    def close(self) -> None:
        """Cancel the request unless it finished: the engine frees its pages at its next step."""
        if not self._finished:
            self._finished = True
            self.handle.cancel()


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
