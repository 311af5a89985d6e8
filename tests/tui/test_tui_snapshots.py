"""Snapshots of the main screen and of the memory inspector (pytest-textual-snapshot).

Nothing live goes into a snapshot: the chats come from a saved database, and the backend is a stand-in whose
memory() returns one fixed picture (three chats, one of them a branch sharing three pages with its parent).
Update with `pytest tests/tui/test_tui_snapshots.py --snapshot-update` after checking the new SVGs by eye.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from textual.widgets import TextArea

from pagedchat.backends.base import BackendInfo
from pagedchat.engine.pages import MemoryCounters
from pagedchat.engine.records import Outcome, PageState
from pagedchat.engine.kv_snapshot import MemorySnapshot, SequenceMemory
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.conversation import ChatMessage, ChatRecord, ChatSettings
from pagedchat.tui.store import Store
from tui_support import StandInBackend, make_config, screen_text

PAGE_BYTES = 16 * 2 * 30 * 3 * 64 * 2   # SmolLM2-135M in bf16: 16 tokens x K,V x 30 layers x 3 heads x 64


def fixed_memory() -> MemorySnapshot:
    states = [PageState.FREE] * 96
    for p in range(0, 5):
        states[p] = PageState.CACHED      # the idle chat's finished exchange
    for p in range(20, 24):
        states[p] = PageState.CACHED      # older prefixes, owner unknown
    for p in range(8, 14):
        states[p] = PageState.USED
    running = SequenceMemory("req-7", "running", 75, 74, [8, 9, 10, 11, 12], 0, 0)
    branch = SequenceMemory("req-8", "running", 60, 59, [8, 9, 10, 13], 0, 48)
    refs = {8: 2, 9: 2, 10: 2, 11: 1, 12: 1, 13: 1}
    counters = MemoryCounters(prefix_queries=6, prefix_hits=4, evictions=2, offloads=3, cpu_hits=1, swap_outs=1,
                              swap_ins=1, recomputes=0, cow_copies=1)
    return MemorySnapshot(
        num_pages=96, free_pages=96 - 6, cached_pages=9, block_size=16, page_bytes=PAGE_BYTES,
        ref_counts=refs, page_states=states,
        shared_pages={p: ["req-7", "req-8"] for p in (8, 9, 10)}, seqs={"req-7": running, "req-8": branch},
        cpu_total=24, cpu_cached=3, cpu_swapped=0, counters=counters, hit_rate=4 / 6, recent_hit_rate=0.75,
        live_tokens=135, contiguous_bytes=2 * 2048 * PAGE_BYTES // 16)


@dataclass(frozen=True)
class LiveRequest:
    """A request the stand-in's memory picture shows running; nothing streams from it."""

    request_id: str

    def cancel(self) -> None:
        pass

    def so_far(self) -> Outcome:
        return Outcome(self.request_id)


def stand_in(progress) -> StandInBackend:
    """What the app reads from a backend when nothing is generated."""
    return StandInBackend(fixed_memory, BackendInfo(model="SmolLM2-135M-Instruct", where="on cuda", block_size=16,
                                                    num_pages=96, page_bytes=PAGE_BYTES))


REPLY = """Paged attention stores the KV cache in fixed-size **pages**, so a sequence only holds what it fills:

```python
def pages_needed(tokens: int, block_size: int = 16) -> int:
    return -(-tokens // block_size)
```

Two requests with the same prompt prefix can map the *same* physical pages."""


def saved_chats(config) -> list[ChatRecord]:
    stats = Outcome(prompt_tokens=42, cached_tokens=32, generated_tokens=61, time_to_first_token=0.031,
                    decode_tokens_per_s=187.4, finish_reason="stop")
    settings = ChatSettings(max_tokens=256, temperature=0.0)
    system = "You are a helpful assistant."
    idle = ChatRecord(id="aaaaaaaaaaaa", title="Paged attention", system_prompt=system, settings=settings,
                      messages=[ChatMessage("user", "How does paged attention save memory?"),
                                ChatMessage("assistant", REPLY, stats)], position=0)
    live = ChatRecord(id="bbbbbbbbbbbb", title="Haiku", system_prompt=system, settings=settings,
                      messages=[ChatMessage("user", "Write a haiku about caches.")], position=1)
    branch = ChatRecord(id="cccccccccccc", title="↳ Haiku", system_prompt=system, settings=settings,
                        messages=[ChatMessage("user", "Write a haiku about caches.")], position=2)
    store = Store.open(config.data_dir)
    for record in (idle, live, branch):
        store.save_chat(record)
    with store.transaction():
        store.put_state("active_chat", idle.id)
    store.close()
    return [idle, live, branch]


@pytest.fixture
def app(tmp_path):
    config = make_config(tmp_path, "/models/SmolLM2-135M-Instruct")
    saved_chats(config)
    return PagedChatApp(config, backend_factory=stand_in)


async def _loaded(pilot) -> None:
    app = pilot.app
    for _ in range(500):
        if app.backend is not None:
            break
        await pilot.pause(0.01)
    _steady_cursors(app)
    await pilot.pause()


def _steady_cursors(app) -> None:
    """A blinking cursor is drawn or not depending on when the picture is taken: hold it on."""
    for area in app.query(TextArea):
        area.cursor_blink = False


def _with_inspector(focus: str):
    async def run_before(pilot) -> None:
        await _loaded(pilot)
        app = pilot.app
        # Tie the stand-in's live requests to the saved chats, as sending would.
        for chat_id, rid in (("bbbbbbbbbbbb", "req-7"), ("cccccccccccc", "req-8")):
            session = app.sessions[chat_id]
            session.reply.start(LiveRequest(rid), index=len(session.record.messages))
        app.sessions["aaaaaaaaaaaa"].pages = (0, 1, 2, 3, 4, 5)
        app.sessions["aaaaaaaaaaaa"].page_tokens = 103
        app.chats.show(app.sessions[focus])
        await pilot.pause()
        await pilot.press("f2")
        await pilot.pause()
        app.refresh_memory(force=True)
        _steady_cursors(app)
        await pilot.pause()

    return run_before


def test_main_screen(app, snap_compare):
    assert snap_compare(app, terminal_size=(100, 32), run_before=_loaded)


def test_main_screen_light_theme(tmp_path, snap_compare):
    config = make_config(tmp_path, "/models/SmolLM2-135M-Instruct", theme="pagedchat-light")
    saved_chats(config)
    app = PagedChatApp(config, backend_factory=stand_in)
    assert snap_compare(app, terminal_size=(100, 32), run_before=_loaded)


def test_inspector(app, snap_compare):
    assert snap_compare(app, terminal_size=(120, 48), run_before=_with_inspector("cccccccccccc"))


def test_inspector_at_80x24(app, snap_compare):
    assert snap_compare(app, terminal_size=(80, 24), run_before=_with_inspector("aaaaaaaaaaaa"))


DEFAULT_POOL = 2340   # pages: a pool of the size the default config gives the default model (thousands)


def big_pool() -> MemorySnapshot:
    picture = fixed_memory()
    return replace(picture, num_pages=DEFAULT_POOL, free_pages=DEFAULT_POOL - 6,
                   page_states=picture.page_states + [PageState.FREE] * (DEFAULT_POOL - 96))


@pytest.mark.parametrize("size", [(140, 45), (80, 24)])
async def test_a_big_pool_leaves_every_inspector_heading_in_view(tmp_path, size):
    """A pool of thousands of pages, one cell each, pushed the sections under the map below the fold."""
    config = make_config(tmp_path, "/models/SmolLM2-135M-Instruct")
    saved_chats(config)
    info = BackendInfo(model="SmolLM2-135M-Instruct", where="on cuda", block_size=16, num_pages=DEFAULT_POOL,
                       page_bytes=PAGE_BYTES)
    app = PagedChatApp(config, backend_factory=lambda progress: StandInBackend(big_pool, info))
    async with app.run_test(size=size) as pilot:
        await _with_inspector("cccccccccccc")(pilot)
        text = screen_text(app)
        for heading in ("Page map", "Sharing and waste", "Chats", "Block table"):
            assert heading in text, f"{heading!r} not in view at {size}:\n{text}"
