"""The widgets inside a chat tab: one message, and the prompt input (the tab itself is chat_view.py).

These widgets know nothing about the engine. The chat feeds a reply's text in with MessageView.feed() as
updates arrive; the view batches it into flushes, spaced so that rendering takes a bounded share
of the machine the engine runs on, and only while the view is displayed (a tab not in view renders when shown);
finish() puts the final text the same way, keeping what settled. Every piece
of text goes through pagedchat.text on its way in, so terminal controls show as pictures; the ChatMessage keeps
the text exactly as written.
"""

from __future__ import annotations

import time
from typing import Protocol

from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.geometry import Size
from textual.message import Message
from textual.reactive import Reactive
from textual.timer import Timer
from rich.markdown import Markdown as RichMarkdown
from textual.widget import Widget
from textual.widgets import Label, Markdown, Static, TextArea

from pagedchat.engine.records import Outcome
from pagedchat.text import plain, visible_controls
from pagedchat.tui.conversation import ChatMessage, stats_line
from pagedchat.tui.streaming import settle_point

# Ten flushes a second read as smooth streaming. Rendering competes with the engine for a core, so each
# flush waits at least RENDER_SPACING times as long as the last one took, its screen update included: the
# flushes then hold the main thread a bounded share of the time. A flush's cost stays about flat as the reply
# grows: the live part is only the last few blocks, one Static (streaming.py). Measurements:
# docs/bench.md#the-app-against-its-engine---app.
FLUSH_S = 0.1
MAX_FLUSH_S = 1.0     # however long appends take, the reply visibly moves every second
CATCH_UP_S = 0.01     # a view just shown renders what it queued at once (Textual takes no timer of 0)
RENDER_SPACING = 20
# TextArea re-wraps an edited line whole on every key, and re-cuts it whole for each screen row it draws: with a
# line past this many characters the input scrolls sideways instead, and a key costs what the line's length does.
WRAP_LIMIT = 10_000


def action_name(method) -> str:
    """The name a Binding gives for an `action_*` method, taken from the method itself: check_action compares
    against this rather than a spelled-out string, so renaming the method breaks where it is named."""
    return method.__name__.removeprefix("action_")


def laid_out_size() -> Reactive[Size]:
    """A virtual size whose change repaints the widget. Textual's own lays the whole screen out again, a frame
    later, though a layout has just set it to what it laid out: a streaming reply's flush cost two layouts, the
    second not lent, as the engine's core had been given back. For widgets whose scrollbars and anchoring the
    layout itself keeps."""
    return Reactive(Size(0, 0), layout=False)


class Blocks(Static):
    """Markdown blocks drawn by Rich in one Static: a streaming reply's live part, and each part that settled."""

    virtual_size = laid_out_size()


class SettledBlocks(Vertical):
    virtual_size = laid_out_size()


class StatsLine(Label):
    """A reply's stats line, rewritten at each flush while it streams."""

    virtual_size = laid_out_size()


class PromptInput(TextArea):
    """Multi-line input: ctrl+j / alt+enter / shift+enter insert a newline (Enter sends: the chat's binding)."""

    BINDINGS = [
        Binding("ctrl+j,alt+enter,shift+enter", "newline", "Newline", show=False, id="newline"),
    ]

    class Recall(Message):
        """Up on the first line (or Down while recalling): step -1 to an older prompt, +1 to a newer one."""

        def __init__(self, prompt: PromptInput, step: int) -> None:
            super().__init__()
            self.prompt = prompt
            self.step = step

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, tab_behavior="focus", show_line_numbers=False,
                         placeholder="Message  (Enter sends · ctrl+j newline · F1 help)", **kwargs)
        self.recalling = False   # the text is a recalled prompt (tui/history.py)

    @on(TextArea.Changed)
    def _wrap_unless_too_long(self) -> None:
        self.soft_wrap = max(map(len, self.document.lines), default=0) <= WRAP_LIMIT

    def _recall_step(self, key: str) -> int | None:
        row, column = self.cursor_location
        if key == "up" and row == 0 and (self.recalling or not self.text or column == 0):
            return -1
        if key == "down" and self.recalling and row == self.document.line_count - 1:
            return 1
        return None

    async def _on_key(self, event: events.Key) -> None:
        # Enter inserts no newline: it goes on up to the chat's binding, which sends. Up and down recall earlier
        # prompts where the cursor cannot move further. Other keys behave as in TextArea.
        if event.key == "enter":
            event.prevent_default()
            return
        if (step := self._recall_step(event.key)) is not None:
            event.stop()
            event.prevent_default()
            self.post_message(self.Recall(self, step))
            return
        await super()._on_key(event)

    def action_newline(self) -> None:
        self.insert("\n")


class MessageActions(Protocol):
    """What the keys on a message do, by its index: the chat that shows it does them (chat_view.ChatView)."""

    def copy_message(self, index: int, code: bool = False) -> None: ...
    async def branch_from(self, index: int) -> None: ...
    def edit_message(self, index: int) -> None: ...
    async def regenerate_from(self, index: int) -> None: ...
    async def focus_message(self, index: int) -> None: ...
    async def action_stop(self) -> None: ...


class CoreSource(Protocol):
    """Where a flush borrows a core for its screen update: the engine, whose steps leave one meanwhile
    (BackendLink; engine/core_loan.py tells why)."""

    async def borrow_core(self) -> None: ...
    def give_back_core(self) -> None: ...


class MessageView(Vertical, can_focus=True):
    """One message. Focus it (alt+up from the input, or click) to copy, branch, edit or regenerate; its keys act
    through `actions`, and a message shown without them (compare's) takes none."""

    BINDINGS = [
        Binding("c", "copy", "Copy", id="message.copy"),
        Binding("k", "copy_code", "Copy code", id="message.copy_code"),
        Binding("b", "branch", "Branch here", id="message.branch"),
        Binding("e", "edit", "Edit & resend", id="message.edit"),
        Binding("r", "regenerate", "Regenerate", id="message.regenerate"),
        Binding("up", "previous", "Previous", show=False),
        Binding("down", "next", "Next", show=False),
        Binding("escape", "back", "Back to input", show=False),
    ]

    virtual_size = laid_out_size()

    def __init__(self, message: ChatMessage, index: int, actions: MessageActions | None = None, *,
                 streamed: int | None = None, cores: CoreSource | None = None) -> None:
        """streamed: the message is a reply still being written, this many tokens so far (its view mounted
        again mid-reply, as when the user scrolls back to it). cores: where its flushes borrow a core."""
        super().__init__(classes=f"message -{message.role}")
        self.message = message
        self.index = index
        self.actions = actions
        self.cores = cores
        self._streaming = streamed is not None
        self._pending: list[str] = []
        self._flush_timer: Timer | None = None
        self._flush_gap = FLUSH_S   # from the last append's end to the next one's start
        self._streamed_tokens = streamed or 0
        self._doing = ""            # the stats line while streaming, before its marks
        self._stalled = False       # the engine has stopped answering
        self._settled_text = ""     # the text the settled Statics show, in order
        self._live_text = ""        # the text the live Static shows
        self._unrendered: str | None = None   # a final text that waits for the view to be shown
        # Composing reads the message afresh (the chat keeps its text current), so until then a reply's text
        # and its end need nothing from the view: a view mounted mid-reply is told of them from its creation.
        self._composed = False

    def compose(self) -> ComposeResult:
        self._composed = True
        yield Label("You" if self.message.role == "user" else "Assistant", classes="role")
        yield SettledBlocks(classes="settled")   # a streaming reply's blocks above its last few (streaming.py)
        live = Blocks(classes="live")            # while it streams, its last few blocks
        live.display = False
        yield live
        yield Markdown(visible_controls(self.message.content), classes="body")
        if self.message.role == "assistant":
            stats = self.message.stats
            line = self._live_line(self._progress()) if self._streaming else stats_line(stats) if stats else ""
            yield StatsLine(plain(line), classes="stats")

    @property
    def body(self) -> Markdown:
        return self.query_one(".body", Markdown)

    @property
    def settled(self) -> Vertical:
        return self.query_one(".settled", Vertical)

    @property
    def live(self) -> Static:
        return self.query_one(".live", Static)

    @property
    def shown_source(self) -> str:
        """The Markdown this view shows, controls made visible: the settled part's, the live part's while it
        streams, then the Markdown widget's."""
        return self._settled_text + self._live_text + self.body.source

    async def _show(self, text: str) -> None:
        """The whole text in the Markdown widget, nothing settled."""
        await self.settled.remove_children()
        self._settled_text = ""
        self._set_live("")
        await self.body.update(visible_controls(text))

    def _set_live(self, text: str) -> None:
        if text != self._live_text:
            self._live_text = text
            self.live.update(RichMarkdown(text) if text else "")
            self.live.display = bool(text)

    async def _put(self, text: str, *, streaming: bool) -> None:
        """Show text (controls already made visible) as the streamed document: what has settled stays, what is
        above the last safe cut (streaming.py) settles into a Static that renders it once, and the rest is
        the live part: while streaming one Static drawn again at each flush (a Markdown widget would mount and
        style a tree of widgets each time), at the end the Markdown widget. The screen's layout then walks a
        handful of widgets however long the reply."""
        if not text.startswith(self._settled_text):
            await self.settled.remove_children()
            self._settled_text = ""
        rest = text[len(self._settled_text):]
        if cut := settle_point(rest):
            await self.settled.mount(Blocks(RichMarkdown(rest[:cut]), classes="settled-part"))
            self._settled_text += rest[:cut]
            rest = rest[cut:]
        live, final = (rest, "") if streaming else ("", rest)
        self._set_live(live)
        if final != self.body.source:
            await self.body.update(final)

    def set_stats(self, text: str) -> None:
        for label in self.query_children(".stats").results(Label):   # not a walk of the reply's blocks
            label.update(plain(text))

    # ---- streaming ----------------------------------------------------------------------------------------
    @property
    def streaming(self) -> bool:
        return self._streaming

    async def start_stream(self, prefix: str = "") -> None:
        """Begin a reply (prefix: text it already has, as when a branch continues a live reply)."""
        if prefix and self._composed:
            await self._show(prefix)
        self._streaming = True
        self._unrendered = None
        self._flush_gap = FLUSH_S
        self._streamed_tokens = 0
        self._stalled = False
        self._show_live("waiting for the first token…")

    def _show_live(self, doing: str) -> None:
        self._doing = doing
        self.set_stats(self._live_line(doing))

    def _live_line(self, doing: str) -> str:
        """The stats line while streaming: what the reply is doing, and whether the engine still answers."""
        if self._stalled:
            return f"stalled: the engine is not answering · {doing}  (Esc stops it, keeping the text)"
        return f"{doing}  (Esc stops)"

    def mark_stalled(self, stalled: bool) -> None:
        """Mark the streaming reply stalled while the engine does not answer, or take the mark back."""
        if self._streaming and stalled != self._stalled:
            self._stalled = stalled
            self._show_live(self._doing)

    def feed(self, text: str, tokens: int) -> None:
        """Queue text for the next flush; cheap, called once per batch of updates. A view nobody can see (its
        tab is not the one shown) only queues: it renders what came when it is shown (on_show)."""
        self._streamed_tokens += tokens
        if not self._composed:
            return
        if text:
            self._pending.append(text)
        if self._flush_timer is None and self.shown:
            self._flush_timer = self.set_timer(self._flush_gap, self._flush)

    @property
    def shown(self) -> bool:
        """Displayed: neither this view nor a container above it (another tab's pane) is hidden."""
        return all(node.display for node in self.ancestors_with_self if isinstance(node, Widget))

    def on_show(self) -> None:
        if self._streaming and self._pending and self._flush_timer is None:
            self._flush_timer = self.set_timer(CATCH_UP_S, self._flush)
        elif self._unrendered is not None:
            self.call_later(self._put_final)

    def _progress(self) -> str:
        return f"generating · {self._streamed_tokens} tokens"

    async def _flush(self) -> None:
        # A flush due after its tab was hidden renders nothing: the text waits, and on_show draws it.
        if not self._streaming or not self.shown:
            self._flush_timer = None
            return
        # The main thread's own CPU time: waiting for its turn on a busy machine is not rendering work.
        started = time.thread_time()
        if self.cores is not None:   # given back once the screen update is drawn (_flushed)
            await self.cores.borrow_core()
            if not self._streaming:   # the reply ended meanwhile, and finish() drew it whole
                self.cores.give_back_core()
                return
        text = "".join(self._pending)
        self._pending.clear()
        if text:
            await self._put(self.shown_source + visible_controls(text), streaming=True)
        # After the text's last await, so that both go in one screen update: each lays out and draws the screen.
        self._show_live(self._progress())
        # Timed to the end of the screen update it causes: the layout and the drawing are most of its cost.
        self.call_after_refresh(self._flushed, started, self._flush_timer)

    def _flushed(self, started: float, timer: Timer | None) -> None:
        if self.cores is not None:
            self.cores.give_back_core()
        if timer is not self._flush_timer:   # the stream ended (or began again) meanwhile
            return
        self._flush_gap = min(MAX_FLUSH_S, max(FLUSH_S, RENDER_SPACING * (time.thread_time() - started)))
        # Cleared only now: text fed meanwhile waits for the next flush instead of racing this one.
        self._flush_timer = None
        if self._pending and self._streaming and self.shown:
            self._flush_timer = self.set_timer(self._flush_gap, self._flush)

    async def finish(self, content: str, stats: Outcome | None) -> None:
        """End streaming: the final text and the stats line. What has settled stays (re-parsing a long reply
        whole held the main thread, keys included, for a long moment at every reply's end); a view nobody can
        see renders it when it is shown."""
        if self._flush_timer is not None:
            self._flush_timer.stop()
            self._flush_timer = None
        self._pending.clear()
        self._streaming = False
        self.message.content = content
        self.message.stats = stats
        if not self._composed:
            return
        self.set_stats(stats_line(stats) if stats else "")
        self._unrendered = content
        if self.shown:
            await self._put_final()

    async def _put_final(self) -> None:
        content, self._unrendered = self._unrendered, None
        if content is not None:
            await self._put(visible_controls(content), streaming=False)

    # ---- keys ---------------------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        return self.actions is not None

    def action_copy(self) -> None:
        self.actions.copy_message(self.index)

    def action_copy_code(self) -> None:
        self.actions.copy_message(self.index, code=True)

    async def action_branch(self) -> None:
        await self.actions.branch_from(self.index)

    def action_edit(self) -> None:
        self.actions.edit_message(self.index)

    async def action_regenerate(self) -> None:
        await self.actions.regenerate_from(self.index)

    async def action_previous(self) -> None:
        await self.actions.focus_message(self.index - 1)

    async def action_next(self) -> None:
        await self.actions.focus_message(self.index + 1)

    async def action_back(self) -> None:
        await self.actions.action_stop()
