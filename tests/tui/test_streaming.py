"""A streaming reply keeps only its last few blocks in the live Markdown widget; the rest settles (streaming.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.app import App
from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static

from pagedchat.tui import chat_widgets
from pagedchat.tui.chat_widgets import MessageView
from pagedchat.tui.message_list import MessageList
from pagedchat.tui.conversation import ChatMessage
from pagedchat.tui.streaming import SETTLE_LINES, settle_point
from tui_support import wait_for

TCSS = Path(chat_widgets.__file__).with_name("pagedchat.tcss")


def guide(items: int) -> str:
    """A long numbered list with nested tips: one top-level Markdown block that grows with the reply."""
    parts = ["# A trip\n\nHere is a guide.\n\n"]
    for i in range(1, items + 1):
        parts.append(f"{i}. **Step {i}** - decide early.\n")
        parts.extend(f"   - Tip {j}: book the `JR` pass.\n" for j in range(3))
    return "".join(parts)


def test_nothing_settles_while_the_text_is_short():
    assert settle_point(guide(2)) == 0


def test_a_long_list_is_cut_at_its_last_item_but_one():
    text = guide(10)
    cut = settle_point(text)
    assert text[cut:].startswith("10. **Step 10**")


def test_never_inside_a_fenced_block_nor_a_table_nor_a_paragraphs_lines():
    fence = "```\n" + "".join(f"line {i}\n\ncode\n" for i in range(SETTLE_LINES)) + "```\nafter"
    assert settle_point("intro\n\n" + fence) == len("intro\n\n")   # before the fence, not inside it
    table = "| a | b |\n|---|---|\n" + "".join(f"| {i} | x |\n" for i in range(SETTLE_LINES + 2)) + "end"
    assert settle_point(table) == 0
    paragraph = "".join(f"word {i}\n" for i in range(SETTLE_LINES + 3))   # one paragraph: lines continue it
    assert settle_point(paragraph) == 0
    heading = "intro\n\n" + "Title\n" + "=====\n" + "".join(f"- {i}\n" for i in range(SETTLE_LINES))
    assert not heading[settle_point(heading):].startswith("=")


class OneMessage(App):
    def compose(self):
        with VerticalScroll():
            yield MessageView(ChatMessage("assistant", ""), 0)


def live_text(view: MessageView) -> str:
    """The text below the settled parts: the live Static's while the reply streams, the Markdown's after."""
    return (view.live.content.markup if view.live.display else "") + view.body.source


def shown_text(view: MessageView) -> str:
    """What the view shows: its settled parts' text, then the live part's (read from the widgets)."""
    settled = view.settled.query(Static).results(Static)
    shown = "".join(part.content.markup for part in settled) + live_text(view)
    assert shown == view.shown_source
    return shown


@pytest.mark.slow  # a long reply: the cut is unit-tested here, test_tui streams a short one
async def test_a_long_reply_streams_into_a_bounded_live_markdown_and_ends_without_a_reparse():
    text = guide(40)
    app = OneMessage()
    async with app.run_test(size=(140, 45)) as pilot:
        view = app.query_one(MessageView)
        await view.start_stream()
        most_live_lines = 0
        for start in range(0, len(text), 40):
            view.feed(text[start:start + 40], 8)
            await pilot.pause(0.12)   # past the flush timer, so each feed is rendered
            most_live_lines = max(most_live_lines, live_text(view).count("\n"))
            assert view.body.source == ""   # while streaming, no Markdown widgets to mount and style
        await pilot.pause(1.2)   # the last flush
        assert shown_text(view) == text
        assert most_live_lines <= 2 * SETTLE_LINES
        parts = list(view.settled.children)
        await view.finish(text, None)
        # The parts that settled stay as they were: a long reply's end is not one long parse of it whole.
        assert list(view.settled.children) == parts
        assert shown_text(view) == text
        assert view.body.source.count("\n") <= SETTLE_LINES
        assert len(view.query(Markdown)) == 1


class HiddenMessage(App):
    """A message in a container that can be hidden, as a tab not shown hides its chat."""

    def compose(self):
        with VerticalScroll(id="pane"):
            yield MessageView(ChatMessage("assistant", ""), 0)

    async def stream_hidden(self, pilot) -> MessageView:
        """The view streaming, with its pane hidden."""
        view = self.query_one(MessageView)
        await view.start_stream()
        self.query_one("#pane").display = False
        await pilot.pause()
        return view


async def test_a_hidden_reply_renders_nothing_until_shown_then_all_at_once_settled():
    text = guide(40)
    app = HiddenMessage()
    async with app.run_test(size=(140, 45)) as pilot:
        view = await app.stream_hidden(pilot)
        for start in range(0, len(text), 400):
            view.feed(text[start:start + 400], 80)
            await pilot.pause(0.15)
        assert shown_text(view) == ""   # no Markdown work for a view nobody sees
        app.query_one("#pane").display = True
        await wait_for(pilot, lambda: shown_text(view) == text and live_text(view).count("\n") <= SETTLE_LINES,
                       "the catch-up drawn and settled")   # a few lines drawn again


async def test_a_reply_that_ends_hidden_shows_its_final_text_when_shown():
    text = guide(30)
    app = HiddenMessage()
    async with app.run_test(size=(140, 45)) as pilot:
        view = await app.stream_hidden(pilot)
        view.feed(text[:200], 20)
        await view.finish(text, None)
        assert shown_text(view) == ""
        app.query_one("#pane").display = True
        await wait_for(pilot, lambda: shown_text(view) == text, "the final text shown")
        assert not view.streaming


class EmptyList(App):
    def compose(self):
        yield VerticalScroll()


def reply_so_far(text: str) -> tuple[ChatMessage, MessageView]:
    """A live reply's message and a view of it made mid-reply, as a page mounted on a scroll back makes it."""
    message = ChatMessage("assistant", text)
    return message, MessageView(message, 0, streamed=len(text.split()))


def take(message: ChatMessage, view: MessageView, text: str) -> None:
    """What the chat does with a reply's update: the message's text first, then the view told."""
    message.content += text
    view.feed(text, len(text.split()))


async def test_a_view_told_of_its_reply_before_it_composes_shows_each_word_once():
    app = EmptyList()
    async with app.run_test(size=(140, 45)) as pilot:
        message, view = reply_so_far("one two ")
        take(message, view, "three ")   # the view is in the list, not yet composed
        await app.query_one(VerticalScroll).mount(view)
        take(message, view, "four")
        await wait_for(pilot, lambda: shown_text(view) == "one two three four"
                       and "4 tokens" in str(view.query_one(".stats").content), "the flush, each word once")
        assert view.streaming


async def test_a_reply_that_ends_before_its_view_composes_shows_its_end():
    app = EmptyList()
    async with app.run_test(size=(140, 45)) as pilot:
        message, view = reply_so_far("one two ")
        await view.finish("one two three", None)
        await app.query_one(VerticalScroll).mount(view)
        await pilot.pause()
        assert not view.streaming and shown_text(view) == "one two three"
        assert "generating" not in str(view.query_one(".stats").content)


class Cores:
    """A CoreSource that counts, and notes what the view showed when each core came back."""

    def __init__(self):
        self.view: MessageView | None = None
        self.borrowed = self.given_back = 0
        self.shown_at_give_back: list[str] = []

    async def borrow_core(self) -> None:
        self.borrowed += 1

    def give_back_core(self) -> None:
        self.given_back += 1
        self.shown_at_give_back.append(shown_text(self.view))


async def test_each_flush_borrows_a_core_and_gives_it_back_once_its_text_is_drawn():
    cores = Cores()

    class Borrowing(App):
        def compose(self):
            with VerticalScroll():
                yield MessageView(ChatMessage("assistant", ""), 0, cores=cores)

    app = Borrowing()
    async with app.run_test(size=(140, 45)) as pilot:
        view = cores.view = app.query_one(MessageView)
        await view.start_stream()
        text = ""
        for i in range(3):
            view.feed(f"part {i}. ", 3)
            text += f"part {i}. "
            # Past the flush and its screen update: a fixed pause lost the race on a loaded CI machine.
            await wait_for(pilot, lambda: cores.given_back > i, f"part {i}'s core given back")
            assert cores.borrowed == cores.given_back == i + 1
            assert cores.shown_at_give_back[-1] == text


async def test_a_flush_lays_the_screen_out_once():
    """Textual lays the screen out again, a frame later, when a layout changes a widget's virtual size. A reply's
    widgets and the chat's list repaint instead (the layout set that size), so a flush costs one layout."""
    # A question taller than the screen: the list scrolls from the start (its scrollbar's coming is a layout too).
    messages = [ChatMessage("user", "\n\n".join(f"line {i}" for i in range(60))), ChatMessage("assistant", "")]

    class Chat(App):
        CSS_PATH = TCSS   # the app's heights: replies as tall as their text, the list scrolling

        def compose(self):
            yield MessageList(lambda: messages, lambda message, index: MessageView(message, index), lambda: None)

    app = Chat()
    async with app.run_test(size=(140, 45)) as pilot:
        log = app.query_one(MessageList)
        await log.show_last()
        log.anchor()
        view = log.view_at(1)
        await view.start_stream()
        await pilot.pause(0.3)
        screen, layouts, flushes = app.screen, [], []
        lay_out, flushed = screen._refresh_layout, view._flushed

        def counted_layout(*args, **kwargs):
            if screen._layout_required:   # a layout, not a scroll's reflow
                layouts.append(1)
            return lay_out(*args, **kwargs)

        def counted_flush(*args):
            flushes.append(1)
            return flushed(*args)

        screen._refresh_layout, view._flushed = counted_layout, counted_flush
        # One paragraph, growing by a few wrapped lines a flush: nothing settles (a settled part's mount is a layout
        # of its own), while the reply and the list's scrollable height grow at each flush.
        words = [f"word{i}" for i in range(1000)]
        for i in range(10):
            view.feed(" ".join(words[i * 100:(i + 1) * 100]) + " ", 100)
            await pilot.pause(0.3)
        await pilot.pause(1.5)   # the last flush, and a frame for any layout after it
        assert view.shown_source == " ".join(words) + " " and len(view.settled.children) == 0
        assert len(flushes) >= 2 and len(layouts) == len(flushes)
        assert log.scroll_y == log.max_scroll_y > 0   # at the end as it grew
