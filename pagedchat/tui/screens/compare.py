"""Compare: the chat's last prompt answered twice, with two settings, side by side and at the same time.

Both answers are new requests on the chat's history up to its last prompt. With the same system prompt their
prompt ids are the same, so the engine's prefix cache maps both onto the pages the chat already filled, shared
copy-on-write; the inspector on this screen (F2) shows the two requests on those pages. Either answer can be
kept as a chat of its own, a branch of the original.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field, replace

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, Label, TextArea

from pagedchat.backends.base import Backend
from pagedchat.engine.records import FinishReason, Outcome, Update
from pagedchat.tui.bridge import UpdateInbox, UpdatesReady
from pagedchat.tui.chat_widgets import MessageView, action_name
from pagedchat.tui.chat_view import BUSY_NOTICE
from pagedchat.tui.inspector import ChatPages, InspectorView
from pagedchat.tui.conversation import ChatMessage, ChatRecord, ChatSettings, reply_stats
from pagedchat.tui.reply import Reply
from pagedchat.tui.screens.modals import Dialog
from pagedchat.tui.session import ChatSession
from pagedchat.tui.themes import chat_colour

TICK_S = 0.25
SIDES = ("A", "B")


@dataclass(frozen=True)
class Variant:
    """One side's settings."""

    system_prompt: str
    settings: ChatSettings

    def summary(self) -> str:
        s = self.settings
        system = " ".join(self.system_prompt.split())[:40] or "(none)"
        return f"temperature {s.temperature:g} · max tokens {s.max_tokens} · system: {system}"


def default_variants(record: ChatRecord) -> tuple[Variant, Variant]:
    """The chat's own settings, against the same with another temperature (greedy becomes 0.8, else greedy)."""
    other = 0.8 if record.settings.temperature == 0 else 0.0
    return (Variant(record.system_prompt, deepcopy(record.settings)),
            Variant(record.system_prompt, replace(deepcopy(record.settings), temperature=other)))


class CompareSetupScreen(Dialog):
    """The two variants: temperature, max tokens and system prompt for each. Dismisses with (Variant, Variant)."""

    BINDINGS = [Binding("ctrl+s", "run", "Compare", id="compare.run")]

    def __init__(self, variants: tuple[Variant, Variant]) -> None:
        super().__init__()
        self._variants = variants

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog -wide"):
            yield Label("Compare: answer the last prompt twice, side by side", classes="dialog-title")
            with Grid(classes="compare-grid"):
                yield Label("")
                for name in SIDES:
                    yield Label(name, classes="compare-side")
                yield Label("Temperature")
                for name, v in zip(SIDES, self._variants):
                    yield Input(f"{v.settings.temperature:g}", id=f"temperature-{name}", type="number", compact=True)
                yield Label("Max tokens")
                for name, v in zip(SIDES, self._variants):
                    yield Input(str(v.settings.max_tokens), id=f"max_tokens-{name}", type="integer", compact=True)
                yield Label("System prompt")
                for name, v in zip(SIDES, self._variants):
                    yield TextArea(v.system_prompt, id=f"system-{name}", soft_wrap=True, tab_behavior="focus")
            yield Label("", id="error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Compare", variant="primary", id="run")
                yield Button("Cancel", id="cancel")
            yield Label("ctrl+s runs both · Esc cancels", classes="dialog-hint")

    def _read(self, name: str, base: Variant) -> Variant:
        try:
            temperature = float(self.query_one(f"#temperature-{name}", Input).value)
            max_tokens = int(self.query_one(f"#max_tokens-{name}", Input).value)
        except ValueError:
            raise ValueError(f"{name}: temperature and max tokens need numbers") from None
        if temperature < 0 or max_tokens < 1:
            raise ValueError(f"{name}: temperature must be 0 or more and max tokens at least 1")
        system = self.query_one(f"#system-{name}", TextArea).text
        return Variant(system, replace(base.settings, temperature=temperature, max_tokens=max_tokens))

    def action_run(self) -> None:
        try:
            variants = tuple(self._read(name, v) for name, v in zip(SIDES, self._variants))
        except ValueError as exc:
            self.query_one("#error", Label).update(str(exc))
            return
        self.dismiss(variants)

    @on(Input.Submitted)
    @on(Button.Pressed, "#run")
    def _run(self) -> None:
        self.action_run()


@dataclass(eq=False)
class Side:
    """One answer while it is written: its reply (the app's Reply, as a chat's) and, at the end, its outcome."""

    name: str
    variant: Variant
    view: MessageView
    reply: Reply = field(default_factory=Reply)
    outcome: Outcome | None = None

    @property
    def running(self) -> bool:
        return self.reply.live and self.outcome is None

    def tokens_held(self) -> int:
        """Prompt plus generated tokens: final from the outcome, else as they stand."""
        if self.outcome is not None:
            return self.outcome.total_tokens
        return self.reply.tokens_held() if self.reply.live else 0


class CompareScreen(Screen):
    BINDINGS = [
        Binding("1", "keep(0)", "Keep A", id="compare.keep_a"),
        Binding("2", "keep(1)", "Keep B", id="compare.keep_b"),
        Binding("s", "stop", "Stop both", id="compare.stop"),
        Binding("escape", "back", "Back", id="compare.back"),
    ]

    def __init__(self, parent: ChatSession, variants: tuple[Variant, Variant], backend: Backend) -> None:
        super().__init__()
        self.parent_session = parent
        self.backend = backend
        record = parent.record
        last_user = max(i for i, m in enumerate(record.messages) if m.role == "user")
        self.history = deepcopy(record.messages[:last_user + 1])
        self.sides = [Side(name, v, MessageView(ChatMessage("assistant", ""), last_user + 1))
                      for name, v in zip(SIDES, variants)]
        self.inbox = UpdateInbox(self)

    def compose(self) -> ComposeResult:
        question = " ".join(self.history[-1].content.split())
        yield Label(f"Compare · {self.parent_session.record.title} · “{question[:80]}”", id="compare-title")
        with Horizontal(id="compare-main"):
            for side in self.sides:
                with Vertical(classes="compare-pane"):
                    yield Label(f"{side.name} · {side.variant.summary()}", classes="compare-summary")
                    with VerticalScroll(classes="log"):
                        yield side.view
            yield InspectorView(id="compare-inspector")
        yield Footer(compact=True)

    @property
    def inspector(self) -> InspectorView:
        return self.query_one("#compare-inspector", InspectorView)

    async def on_mount(self) -> None:
        for side in self.sides:
            await self._submit(side)
        self.set_interval(TICK_S, self._tick)

    async def _submit(self, side: Side) -> None:
        backend = self.backend
        parent = self.parent_session
        conversation = ChatRecord(system_prompt=side.variant.system_prompt, messages=self.history).conversation()
        # The parent's exact ids keep the shared pages shared; they only hold for the same system prompt.
        same = side.variant.system_prompt == parent.record.system_prompt
        try:
            handle = backend.submit(conversation, side.variant.settings.params(),
                                    previous=parent.previous(len(self.history)) if same else None,
                                    on_update=self.inbox.callback(side.name))
        except Exception as exc:  # too long for the context or the cache, a template or settings problem
            await side.view.finish("", None)
            side.view.set_stats(f"not started: {exc}")
            return
        side.reply.start(handle, side.view.index)
        await side.view.start_stream()

    async def on_updates_ready(self, event: UpdatesReady) -> None:
        event.stop()   # this screen's inbox, not the app's
        batches: dict[str, list[Update]] = {}
        for name, update in self.inbox.take():
            batches.setdefault(name, []).append(update)
        for side in self.sides:
            updates = [u for u in batches.get(side.name, ()) if side.reply.takes(u.request_id)]
            if updates:
                await self._take(side, updates)
        self.refresh_bindings()

    async def _take(self, side: Side, updates: list[Update]) -> None:
        fed = side.reply.feed(updates)
        for notice in fed.notices:
            self.app.notify(notice, severity="warning", timeout=8)
        if fed.outcome is None:
            side.view.feed(fed.text, fed.tokens)
            return
        ending = side.reply.finish(fed.outcome)
        side.outcome = fed.outcome
        await side.view.finish(ending.content, ending.stats)

    def chat_pages(self) -> list[ChatPages]:
        variables = self.app.theme_variables
        parent = self.parent_session
        out = [ChatPages(parent.id, parent.record.title, chat_colour(variables, parent.colour), None, parent.pages,
                         parent.page_tokens)]
        for n, side in enumerate(self.sides):
            pages = side.outcome.pages if side.outcome is not None else ()
            tokens = side.tokens_held()
            colour = chat_colour(variables, parent.colour + 1 + n)
            out.append(ChatPages(f"compare-{side.name}", f"{side.name} · {parent.record.title}", colour,
                                 side.reply.request_id if side.running else None, pages, tokens))
        return out

    def _tick(self, force: bool = False) -> None:
        if not self.inspector.display:
            return
        pages = self.chat_pages()
        self.inspector.update_view(self.backend.memory(), pages, pages[1], force=force)

    def toggle_inspector(self) -> None:
        self.inspector.display = not self.inspector.display
        self._tick(force=True)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # "s" shows in the footer only while a side is being written.
        return any(side.running for side in self.sides) if action == action_name(CompareScreen.action_stop) else True

    def action_stop(self) -> None:
        for side in self.sides:
            if side.running:
                side.reply.handle.cancel()   # the final update arrives as CANCELLED

    def action_back(self) -> None:
        self.action_stop()
        self.dismiss(None)

    async def action_keep(self, n: int) -> None:
        side = self.sides[n]
        if side.outcome is None:
            self.app.notify(f"{side.name} is still being written: wait, or press s to stop both.",
                            severity="warning")
            return
        self.action_stop()
        self.dismiss(self.kept(side))

    def kept(self, side: Side) -> ChatSession:
        """The side as a chat of its own: the history, its answer, its settings, its outcome (the next turn's
        prompt reuses it)."""
        done = side.outcome
        parent = self.parent_session
        reply = ChatMessage("assistant", done.text, reply_stats(done))
        record = ChatRecord(title=f"{side.name}: {parent.record.title}"[:40], system_prompt=side.variant.system_prompt,
                            settings=deepcopy(side.variant.settings), messages=deepcopy(self.history) + [reply])
        session = ChatSession(record)
        index = len(record.messages) - 1
        if done.finish_reason is not FinishReason.ERROR:
            session.turns[index] = done
        session.pages = done.pages
        session.page_tokens = done.total_tokens
        return session


def start_compare(app) -> None:
    """F5 / palette: ask for the two variants, then show both answers being written."""
    session = app.active_session
    backend = app.link.ready_or_say() if session is not None else None
    if backend is None:
        return
    if not any(m.role == "user" for m in session.record.messages):
        app.notify("Nothing to compare yet: send a message first.", severity="warning")
        return
    if session.busy:
        app.notify(BUSY_NOTICE, severity="warning")
        return

    async def keep(kept: ChatSession | None) -> None:
        if kept is not None and session.id in app.sessions:
            (await app.chats.open(kept, after=session)).save(messages=True)
            app.notify(f"Kept as “{kept.record.title}”.", timeout=4)

    def chosen(variants: tuple[Variant, Variant] | None) -> None:
        if variants is not None:
            app.push_screen(CompareScreen(session, variants, backend), keep)

    app.push_screen(CompareSetupScreen(default_variants(session.record)), chosen)
