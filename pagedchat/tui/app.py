"""The pagedchat app: chat tabs over one backend, streaming replies, the memory inspector, saved chats.

The backend (pagedchat.backends) is the in-process engine or an OpenAI-compatible server; the app sees only
its face. Threads: the backend streams on its own thread and hands updates to DeltaInbox, which wakes the UI
with one DeltasReady message at a time; the backend starts (model load, or server connect) on a daemon
thread. Everything else, including SQLite writes (a few ms, when a chat changes and twice a second per
streaming reply), runs on Textual's event loop, so no widget is ever touched off-thread. What is saved when is
marked through a Saver (`saver.py`).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterable
from copy import deepcopy
from pathlib import Path
from typing import Callable

from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.content import Content
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Label, ProgressBar, TabbedContent, TabPane

from pagedchat.backends.base import Backend, Outcome, request_pages
from pagedchat.config import DEFAULT_THEME, AppConfig
from pagedchat.errors import PagedChatError
from pagedchat.text import escaped_markup, visible_controls
from pagedchat.tui import chat_ops, context
from pagedchat.tui.bridge import DeltaInbox, DeltasReady, EngineFailed, EngineReady, LoadProgress, start_loading
from pagedchat.tui.chat import ChatView, MessageView, PromptInput
from pagedchat.tui.commands import ChatCommands
from pagedchat.tui.history import PromptHistory
from pagedchat.tui.inspector import ChatPages, InspectorView
from pagedchat.tui.records import ChatMessage, ChatRecord, ChatSettings, ReplyStats, title_from
from pagedchat.tui.saver import RETRY_S, Saver
from pagedchat.tui.screens.compare import CompareScreen, start_compare
from pagedchat.tui.screens.help import HelpScreen
from pagedchat.tui.screens.modals import ChatSettingsScreen, EditMessageScreen, PickScreen, RenameScreen
from pagedchat.tui.session import ChatSession
from pagedchat.tui.store import BUSY_TIMEOUT_S, Store
from pagedchat.tui.themes import chat_colours, load_themes

TICK_S = 0.25          # inspector refresh and page-ownership polling
SAVE_EVERY_S = 0.5     # a streaming reply is saved this often, so a crash loses under a second of it
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP) if hasattr(signal, "SIGHUP") else (signal.SIGTERM,)
PANE_PREFIX = "chat-"

BackendFactory = Callable[[Callable[[str, "float | None"], None]], Backend]


def default_backend_factory(config: AppConfig) -> BackendFactory:
    """The server named by --server / `server =`, else the engine in this process."""
    def connect(progress) -> Backend:
        from pagedchat.backends.remote import RemoteBackend

        progress(f"connecting to {config.server}", None)
        return RemoteBackend(config.server, config.api_key, config.model, progress)

    def load(progress) -> Backend:
        from pagedchat.backends.local import LocalBackend
        from pagedchat.engine.engine import Engine  # torch and transformers load here, off the UI thread

        # Every core computes, the event loop's included: it needs little CPU between steps. On 2 cores, two
        # chats streaming 160 tokens each ran 1.4-1.75x faster in the app than with a core left to the event
        # loop, whose timer then fired late by 8-12 ms at p95 and 26 ms at worst (6 and 16 with the core left).
        try:
            engine = Engine(config.model, kv_cache_memory=config.kv_cache_memory, block_size=config.block_size,
                            device=config.device, dtype=config.dtype, swap_space=config.swap_space,
                            threads=config.threads, progress=progress, quantize=config.quantize)
        except Exception as exc:
            raise PagedChatError(f"The model could not be loaded: {exc}") from exc
        return LocalBackend(engine)

    return connect if config.server else load


class PagedChatApp(App):
    CSS_PATH = "pagedchat.tcss"
    TITLE = "pagedchat"
    COMMANDS = App.COMMANDS | {ChatCommands}   # search, history, delete, import, compare (tui/commands.py)

    # Priority: the app's keys work whatever has focus, and a key remapped in config.toml onto one the
    # TextArea also uses (it takes f6/f7, ctrl+w, ...) still reaches the app.
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True, id="quit"),
        Binding("ctrl+n", "new_chat", "New", priority=True, id="new_chat"),
        Binding("ctrl+w", "close_chat", "Close", priority=True, id="close_chat"),
        Binding("f1", "help", "Help", priority=True, id="help"),
        Binding("f2", "toggle_inspector", "Memory", priority=True, id="toggle_inspector"),
        Binding("f3", "chat_settings", "Settings", priority=True, id="chat_settings"),
        Binding("f4", "rename_chat", "Rename", show=False, priority=True, id="rename_chat"),
        Binding("ctrl+pagedown", "next_chat", "Next chat", show=False, priority=True, id="next_chat"),
        Binding("ctrl+pageup", "prev_chat", "Previous chat", show=False, priority=True, id="prev_chat"),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False, priority=True, id="regenerate"),
        Binding("ctrl+b", "branch", "Branch", show=False, priority=True, id="branch"),
        Binding("ctrl+o", "export_chat", "Export", show=False, priority=True, id="export_chat"),
        Binding("f5", "compare", "Compare", show=False, priority=True, id="compare"),
        Binding("f8", "delete_chat", "Delete chat", show=False, priority=True, id="delete_chat"),
    ]

    def __init__(self, config: AppConfig, *, backend_factory: BackendFactory | None = None,
                 open_store: Callable[[Path], Store] = Store.open) -> None:
        super().__init__()
        self.config = config
        self._open_store_at = open_store
        self.backend: Backend | None = None
        self.backend_error: str | None = None
        self._stop_noted = False                      # the backend's failure has been shown
        self._factory = backend_factory or default_backend_factory(config)
        self.inbox = DeltaInbox(self)
        self.sessions: dict[str, ChatSession] = {}
        self.requests: dict[str, str] = {}           # live request id -> chat id
        self.store: Store | None = None
        self.saver: Saver | None = None
        self._startup_notes: list[tuple[str, str]] = []
        loaded = load_themes(config.user_theme_dir)
        for theme in loaded.themes:
            self.register_theme(theme)
        for error in loaded.errors:
            self._startup_notes.append((f"Theme skipped: {error}", "warning"))

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Every notification is plain text, controls shown as pictures: they carry chat titles, paths and
        error messages. `markup` is accepted for Widget.notify, which passes True by default, and ignored."""
        super().notify(visible_controls(message), title=visible_controls(title), severity=severity,
                       timeout=timeout, markup=False)

    # ---- layout -----------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield TabbedContent(id="chats")
            yield InspectorView(id="inspector")
        with Horizontal(id="statusbar"):
            yield Label("connecting to the server…" if self.config.server else "loading the model…", id="status")
            yield ProgressBar(total=None, show_eta=False, id="load-progress")
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        self.store = self._open_store()
        self.saver = Saver(self.store, lambda text, severity: self.notify(text, severity=severity, timeout=10))
        self._install_exit_signals()
        self.prompt_history = PromptHistory(self.store.recent_prompts())
        self._apply_theme()
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        self._apply_keymap()
        await self._restore_chats()
        for text, severity in self._startup_notes:
            self.notify(text, severity=severity, timeout=10)
        start_loading(self, self._factory)
        self.set_interval(TICK_S, self._tick)
        self.set_interval(RETRY_S, self.saver.retry)  # a no-op unless a write failed

    def _open_store(self) -> Store:
        try:
            store = self._open_store_at(self.config.data_dir)
        except OSError as exc:
            store = Store.in_memory(f"Cannot write saved chats in {self.config.data_dir} ({exc.strerror or exc}); "
                                    "chats in this session will not be kept.")
        if store.notice:
            self._startup_notes.append((store.notice, "error"))
        return store

    def _apply_theme(self) -> None:
        """config/CLI theme if it changed since the user last picked one in the app, else their pick."""
        wanted, remembered = self.config.theme, self.store.get_state("theme")
        if wanted and wanted != self.store.get_state("theme_config"):
            choice = wanted
        else:
            choice = remembered or wanted or DEFAULT_THEME
        if choice not in self.available_themes:
            if choice != DEFAULT_THEME:
                self._startup_notes.append((f"No theme named {choice!r}; using {DEFAULT_THEME}.", "warning"))
            choice = DEFAULT_THEME if DEFAULT_THEME in self.available_themes else "textual-dark"
        self.theme = choice

    def _on_theme_changed(self, theme) -> None:
        if self.saver is not None:
            self.saver.state("theme", theme.name)
            self.saver.state("theme_config", self.config.theme or "")
            self.saver.flush()
        for session in self.sessions.values():
            self._refresh_label(session)
        self._tick(force=True)

    def _apply_keymap(self) -> None:
        known = {b.id for b in binding_catalogue() if b.id}
        unknown = sorted(set(self.config.keys) - known)
        if unknown:
            self._startup_notes.append((f"config.toml [keys]: unknown binding id {', '.join(unknown)} "
                                        "(F1 lists them)", "warning"))
        self.set_keymap({k: v for k, v in self.config.keys.items() if k in known})

    # ---- chats and tabs -----------------------------------------------------------------------------------
    @property
    def tabs(self) -> TabbedContent:
        return self.query_one("#chats", TabbedContent)

    async def _restore_chats(self) -> None:
        records = self.store.load_chats(open_only=True)
        for record in records:
            await self._open_session(ChatSession(record), activate=False)
        if not records:
            await self.action_new_chat()
            return
        active = self.store.get_state("active_chat")
        if active in self.sessions:
            self._show(self.sessions[active])
        await self._activated(self.active_session)

    def _next_colour(self) -> int:
        used = {s.colour for s in self.sessions.values()}
        return next(i for i in range(len(used) + 1) if i not in used)

    async def _open_session(self, session: ChatSession, *, after: ChatSession | None = None,
                            activate: bool = True) -> ChatView:
        session.colour = self._next_colour()
        self.sessions[session.id] = session
        view = ChatView(session.id, session.record.messages)
        pane = TabPane(self._label(session), view, id=PANE_PREFIX + session.id)
        await self.tabs.add_pane(pane, after=(PANE_PREFIX + after.id) if after else None)
        if activate:
            self._show(session)
            await self._activated(session)
        self._save_order()
        return view

    def _show(self, session: ChatSession) -> None:
        """Bring a chat's tab forward. Focus leaves the old tab first: a focused widget in a pane being hidden
        hands focus to a sibling in that same pane, and TabbedContent then switches straight back to it."""
        if self.tabs.active != PANE_PREFIX + session.id:
            self.screen.set_focus(None)
            self.tabs.active = PANE_PREFIX + session.id

    def _colour_of(self, session: ChatSession) -> str:
        colours = chat_colours(self.theme_variables)
        return colours[session.colour % len(colours)]

    def _label(self, session: ChatSession) -> Content:
        parts: list = [("■", self._colour_of(session)), " ", visible_controls(session.record.title)]
        if session.busy:
            parts.append((" ●", "$warning"))   # generating: shown in every tab, and visible from the others
        elif session.unseen:
            parts.append((" ●", "$success"))   # a reply finished while the tab was not in view
        return Content.assemble(*parts)

    def _refresh_label(self, session: ChatSession) -> None:
        try:
            self.tabs.get_tab(PANE_PREFIX + session.id).label = self._label(session)
        except Exception:  # the tab is being removed
            pass

    @property
    def active_session(self) -> ChatSession | None:
        pane = self.tabs.active
        return self.sessions.get(pane[len(PANE_PREFIX):]) if pane else None

    def chat_view(self, session: ChatSession) -> ChatView | None:
        try:
            return self.tabs.get_pane(PANE_PREFIX + session.id).query_one(ChatView)
        except Exception:
            return None

    def ordered_sessions(self) -> list[ChatSession]:
        tabs = self.tabs.query("ContentTab")
        ids = [t.id.removeprefix("--content-tab-").removeprefix(PANE_PREFIX) for t in tabs if t.id]
        return [self.sessions[i] for i in ids if i in self.sessions]

    @on(TabbedContent.TabActivated, "#chats")
    async def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        await self._activated(self.active_session)

    async def _activated(self, session: ChatSession | None) -> None:
        if session is None:
            return
        session.unseen = False
        self._refresh_label(session)
        view = self.chat_view(session)
        if view is not None:
            await view.populate()
            if not isinstance(self.focused, MessageView) or self.focused not in view.views:
                view.prompt.focus()
        self.saver.state("active_chat", session.id)
        self.saver.flush()
        context.show_fill(self, session)
        self._tick(force=True)

    def _save_order(self) -> None:
        sessions = self.ordered_sessions()
        for i, s in enumerate(sessions):
            s.record.position = i
        self.saver.order([s.id for s in sessions])
        self.saver.flush()

    def _save(self, session: ChatSession, *indexes: int, row: bool = False, messages: bool = False) -> None:
        """Save what changed: messages at `indexes`, the chat's row, or (messages=True) all of it. A live
        reply is saved as its snapshot, marked interrupted until it finishes."""
        record = session.record
        if row or messages:
            self.saver.chat(record, messages=messages)
        for index in indexes:
            self.saver.message(record, index)
        if session.busy and session.reply_index is not None and (messages or session.reply_index in indexes):
            self._save_reply(session)
        self.saver.flush()

    def _save_reply(self, session: ChatSession) -> None:
        self.saver.message(session.record, session.reply_index, session.reply_snapshot())
        session.saved_at = time.monotonic()

    # ---- sending and streaming -----------------------------------------------------------------------------
    def _backend_or_say(self) -> Backend | None:
        """The backend, or a notice why there is none; one that failed to start is started again."""
        if self.backend is not None and self.backend.failure is not None:
            self.notify(f"{self._stopped_text()} Your message is kept in the input.", severity="error", timeout=10)
            return None
        if self.backend is None and self.backend_error:
            self.notify(f"{self.backend_error} Trying again; your message is kept in the input.",
                        severity="error", timeout=8)
            self._start_backend()
        elif self.backend is None:
            self.notify("The model is still loading; your message is kept in the input.", severity="warning")
        return self.backend

    def _start_backend(self) -> None:
        self.backend_error = None
        bar = self._load_bar()
        if bar is not None:
            bar.display = True
            bar.update(total=None)
        start_loading(self, self._factory)

    # ---- an engine that stopped, and its restart ------------------------------------------------------------
    def _stopped_text(self) -> str:
        return f"engine stopped: {self.backend.failure}. Restart it from the command palette (Restart engine)."

    def _note_engine_stopped(self) -> bool:
        """Once per failure: say in the status bar and a notice that the engine stopped, and how to restart."""
        if self.backend.failure is None:
            return False
        if not self._stop_noted:
            self._stop_noted = True
            self._update_status()
            self.notify(self._stopped_text(), severity="error", timeout=15)
        return True

    def restart_engine(self) -> None:
        """Load a fresh engine in place of one that stopped; the chats stay as they are."""
        old, self.backend, self._stop_noted = self.backend, None, False
        if old is not None:
            old.shutdown()
        self.query_one("#status", Label).update("loading the model…")
        self._start_backend()

    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        view = next((a for a in event.prompt.ancestors if isinstance(a, ChatView)), None)
        session = self.sessions.get(view.chat_id) if view else None
        if session is None:
            return
        if session.busy:
            self.notify("This chat is still replying: wait, or press Esc to stop it.", severity="warning")
            return
        if self._backend_or_say() is None:
            return
        if (notice := context.prompt_too_long(self, session, event.text)) is not None:
            self.notify(notice, severity="warning", timeout=10)
            return
        if await self._start_reply(session, ask=event.text):
            event.prompt.clear()  # only now: a refused message stays in the input
            self.prompt_history.add(event.text)
            self.prompt_history.forget_walk(event.prompt)

    @on(PromptInput.Recall)
    def _recall(self, event: PromptInput.Recall) -> None:
        self.prompt_history.step(event.prompt, event.step)

    async def _start_reply(self, session: ChatSession, keep: int | None = None, ask: str | None = None) -> bool:
        """Ask for a reply to the chat's first `keep` messages (default all; the last is the user's), followed
        by the user's new message `ask` if given. Messages from `keep` on (a reply being regenerated, a message
        being edited and what followed it) are removed only once the backend has accepted the request, so a
        refused one changes nothing. True if the reply started."""
        backend = self._backend_or_say()
        if backend is None:
            return False
        record = session.record
        keep = len(record.messages) if keep is None else keep
        conversation = record.conversation(keep) + ([{"role": "user", "content": ask}] if ask is not None else [])
        try:
            params = record.settings.params()
            handle = backend.submit(conversation, params, previous=session.previous(keep),
                                    on_update=self.inbox.callback(session.id))
        except Exception as exc:  # settings, or a prompt too long for the context or the cache: keep the chat
            self.notify(f"Cannot send: {exc}", severity="error", timeout=10)
            return False
        # The record changes in one go (no await between the cut and the new messages), then the screen.
        dropped = session.truncate(keep)
        if dropped:
            self.saver.removed(record, dropped)
        if ask is not None:
            if not record.messages and record.title == "New chat":
                record.title = title_from(ask)
            record.messages.append(ChatMessage("user", ask))
        record.messages.append(ChatMessage("assistant", ""))
        index = len(record.messages) - 1
        self._track(session, handle, index)
        self._save(session, *range(keep, index + 1), row=True)
        chat = self.chat_view(session)
        if chat is not None:
            await chat.truncate(keep)
            for i in range(keep, index + 1):
                view = await chat.add_message(record.messages[i], i)
            await view.start_stream()
        return True

    def _track(self, session: ChatSession, handle, index: int, prefix: str = "", inheriting: bool = False) -> None:
        session.request_id = handle.request_id
        session.handle = handle
        session.reply_index = index
        session.reply_prefix = prefix
        session.inheriting = inheriting
        session.received_text = ""
        session.received_tokens = 0
        self.requests[handle.request_id] = session.id
        self._refresh_label(session)
        self._update_status()
        self.refresh_bindings()

    async def on_deltas_ready(self, _: DeltasReady) -> None:
        batches: dict[str, list] = {}
        for _chat_id, update in self.inbox.take():
            batches.setdefault(update.request_id, []).append(update)
        for request_id, updates in batches.items():
            session = self.sessions.get(self.requests.get(request_id, ""))
            if session is None or session.request_id != request_id:
                continue  # a closed chat or an abandoned reply: the backend has been told to cancel it
            view = self._reply_view(session)
            inherited = next((u.inherited for u in updates if u.inherited is not None), None)
            if inherited is not None:
                await self._begin_fork_stream(session, view, inherited)
            for notice in {u.notice for u in updates if u.notice}:
                self.notify(notice, severity="warning", timeout=8)
            text = "".join(u.text for u in updates)
            tokens = sum(u.tokens for u in updates)
            session.received_text += text
            session.received_tokens += tokens
            session.record.messages[session.reply_index].content = session.reply_prefix + session.received_text
            final = next((u.outcome for u in updates if u.finished), None)
            if final is not None:
                await self._finish_reply(session, final)
                continue
            if view is not None:
                view.feed(text, tokens)
            if time.monotonic() - session.saved_at >= SAVE_EVERY_S:
                self._save_reply(session)
        self.saver.flush()

    def _reply_view(self, session: ChatSession) -> MessageView | None:
        chat = self.chat_view(session)
        return chat.view_at(session.reply_index) if chat and session.reply_index is not None else None

    async def _begin_fork_stream(self, session: ChatSession, view: MessageView | None, inherited: str) -> None:
        """A branch forked from a live reply: its text so far is the parent's reply up to the fork point."""
        session.inheriting = False
        session.reply_prefix += inherited
        if view is not None:
            await view.start_stream(session.reply_prefix)

    async def _finish_reply(self, session: ChatSession, outcome: Outcome) -> None:
        """The final update: render the whole reply once, record its outcome and stats, then mark the chat idle."""
        self.requests.pop(session.request_id, None)
        index = session.reply_index
        stats = ReplyStats.from_outcome(outcome)
        content = session.reply_prefix + outcome.text
        if outcome.finish_reason != "error":
            session.turns[index] = outcome
        else:
            kept = "The text so far is kept; " if content else ""
            self.notify(f"The reply failed: {outcome.error}. {kept}ctrl+r asks again.", severity="error", timeout=10)
        # The final block table: the inspector colours this idle chat's cached pages by it.
        if outcome.pages:
            session.pages, session.page_tokens = outcome.pages, outcome.total_tokens
        elif not session.pages:
            session.page_tokens = outcome.total_tokens  # a backend that shows no pages: tokens, for estimates
        if not outcome.generated_tokens and not content and outcome.finish_reason in ("cancelled", "error"):
            await self._cut(session, index)  # nothing came: drop the empty reply rather than keep a blank one
            index = None
        else:
            message = session.record.messages[index]
            message.content, message.stats = content, stats
            view = self._reply_view(session)
            if view is not None:
                await view.finish(content, stats)
        # Only now is the chat idle: anything that waits on `busy` sees the finished reply on screen.
        session.request_id = session.handle = None
        session.reply_index = None
        session.reply_prefix = ""
        if session is not self.active_session:
            session.unseen = True
        self._refresh_label(session)
        self._update_status()
        self._tick()  # the inspector shows the chat idle at once, not a tick later as "queued"
        self.refresh_bindings()
        self._save(session, *(() if index is None else (index,)))
        context.after_reply(self, session, outcome.finish_reason)

    async def _abandon(self, session: ChatSession) -> None:
        """Stop a reply now, without waiting for the backend's final update (closing, quitting, editing)."""
        if not session.busy:
            return
        stats = session.live_stats("cancelled")  # before the cancel: the figures as they stand
        session.handle.cancel()
        self.requests.pop(session.request_id, None)
        index = session.reply_index
        message = session.record.messages[index]
        if not session.inheriting:  # (a fork with no update yet keeps the parent's text it started with)
            message.content = session.reply_prefix + session.received_text
        content, message.stats = message.content, stats
        view = self._reply_view(session)
        if view is not None:
            await view.finish(content, stats)
        session.request_id = session.handle = None
        session.inheriting = False
        session.reply_index = None
        session.reply_prefix = ""
        self._refresh_label(session)
        self._update_status()
        self.refresh_bindings()
        self._save(session, index)

    def _install_exit_signals(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            for sig in EXIT_SIGNALS:
                loop.add_signal_handler(sig, self._exit_on_signal)
        except (NotImplementedError, RuntimeError, ValueError):  # no signals here, or not the main thread
            pass

    def _remove_exit_signals(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            for sig in EXIT_SIGNALS:
                loop.remove_signal_handler(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    def _exit_on_signal(self) -> None:
        """SIGTERM, or SIGHUP (the terminal closed): save each live reply as it stands, marked interrupted
        (it did not finish, and nobody stopped it), and exit. Saved first: a closed terminal may not let the
        exit finish."""
        for session in self.sessions.values():
            if session.busy:
                self._save_reply(session)
                self.requests.pop(session.request_id, None)  # its last deltas are not waited for
        self.saver.retry(BUSY_TIMEOUT_S)  # even while writes fail: this is the last chance
        self.exit()

    @on(ChatView.StopRequested)
    def _stop(self, event: ChatView.StopRequested) -> None:
        session = self.sessions.get(event.view.chat_id)
        if session is not None and session.busy:
            session.handle.cancel()  # the final update arrives as "cancelled" with its stats
        elif isinstance(self.focused, MessageView):
            event.view.prompt.focus()

    # ---- actions ------------------------------------------------------------------------------------------
    async def action_new_chat(self) -> None:
        record = ChatRecord(system_prompt=self.config.system_prompt,
                            settings=ChatSettings.from_defaults(self.config.sampling))
        session = ChatSession(record)
        self.saver.chat(record, messages=True)
        await self._open_session(session, after=self.active_session)

    async def action_close_chat(self) -> None:
        session = self.active_session
        if session is None:
            return
        await self._abandon(session)
        session.record.is_open = False
        self._save(session, row=True)
        await self._remove_tab(session)
        self.notify(f"Closed “{session.record.title}”; reopen it from the command palette.", timeout=4)

    async def _remove_tab(self, session: ChatSession) -> None:
        await self._abandon(session)
        del self.sessions[session.id]
        await self.tabs.remove_pane(PANE_PREFIX + session.id)
        if not self.sessions:
            await self.action_new_chat()
        else:
            await self._activated(self.active_session)
        self._save_order()

    def action_delete_chat(self) -> None:
        chat_ops.confirm_delete(self)

    def action_compare(self) -> None:
        start_compare(self)

    async def reopen_chat(self, chat_id: str) -> None:
        record = next((r for r in self.store.load_chats(open_only=False) if r.id == chat_id), None)
        if record is not None and record.id not in self.sessions:
            record.is_open = True
            await self._open_session(ChatSession(record), after=self.active_session)
            self._save(self.sessions[record.id], row=True)

    def _switch(self, step: int) -> None:
        sessions = self.ordered_sessions()
        current = self.active_session
        if current in sessions and len(sessions) > 1:
            self._show(sessions[(sessions.index(current) + step) % len(sessions)])

    def action_next_chat(self) -> None:
        self._switch(1)

    def action_prev_chat(self) -> None:
        self._switch(-1)

    def action_toggle_inspector(self) -> None:
        if isinstance(self.screen, CompareScreen):   # it has an inspector of its own, for its two requests
            self.screen.toggle_inspector()
            return
        inspector = self.query_one(InspectorView)
        inspector.display = not inspector.display
        self._tick(force=True)

    def action_help(self) -> None:
        rows = []
        keymap = self.config.keys
        for b in binding_catalogue():
            rows.append((keymap.get(b.id, b.key), b.description or b.action, b.id))
        paths = (f"## Files\n\n* Saved chats: `{self.store.path}`\n* Exports: `{self.config.data_dir / 'exports'}`\n"
                 f"* Config: `{self.config.config_dir / 'config.toml'}`\n"
                 f"* Your themes: `{self.config.user_theme_dir}/*.toml`")
        self.push_screen(HelpScreen(rows, paths))

    def action_rename_chat(self) -> None:
        session = self.active_session
        if session is None:
            return

        def done(title: str | None) -> None:
            if title and session.id in self.sessions:
                session.record.title = title
                self._refresh_label(session)
                self._save(session, row=True)

        self.push_screen(RenameScreen(session.record.title), done)

    def action_chat_settings(self) -> None:
        session = self.active_session
        if session is None:
            return

        def done(result) -> None:
            if result and session.id in self.sessions:
                session.record.system_prompt, session.record.settings = result
                self._save(session, row=True)
                self.notify("Settings saved; they apply from the next reply.", timeout=3)

        self.push_screen(ChatSettingsScreen(session.record.title, session.record.system_prompt,
                                            session.record.settings), done)

    async def action_regenerate(self, index: int | None = None) -> None:
        session = self.active_session
        if session is None or self._backend_or_say() is None:
            return
        messages = session.record.messages
        last = len(messages) - 1
        if index is not None and index != last:
            self.notify("Only the last reply can be regenerated; press b on a message to branch from it.",
                        severity="warning")
            return
        if not messages:
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        await self._abandon(session)
        await self._start_reply(session, keep=last if messages[-1].role == "assistant" else last + 1)

    async def _cut(self, session: ChatSession, count: int) -> None:
        dropped = session.truncate(count)
        if dropped:
            self.saver.removed(session.record, dropped)
        view = self.chat_view(session)
        if view is not None:
            await view.truncate(count)

    def edit_message(self, index: int) -> None:
        session = self.active_session
        if session is None or index >= len(session.record.messages):
            return
        if session.record.messages[index].role != "user":
            self.notify("Only your own messages can be edited; regenerate or branch a reply instead.",
                        severity="warning")
            return

        async def done(text: str | None) -> None:
            if text is None or session.id not in self.sessions or self._backend_or_say() is None:
                return
            await self._abandon(session)
            await self._start_reply(session, keep=index, ask=text)

        self.push_screen(EditMessageScreen(session.record.messages[index].content), done)

    async def action_branch(self, index: int | None = None) -> None:
        session = self.active_session
        if session is None:
            return
        if index is None:
            view = self.chat_view(session)
            focused = view.focused_message if view else None
            index = focused.index if focused else len(session.record.messages) - 1
        if index < 0:
            self.notify("Nothing to branch yet: send a message first.", severity="warning")
            return
        if session.busy and index == session.reply_index:
            await self._fork_live(session)
        else:
            await self._branch_at(session, index)

    def _branch_record(self, session: ChatSession, messages: list[ChatMessage]) -> ChatRecord:
        src = session.record
        return ChatRecord(title=f"↳ {src.title}"[:40], system_prompt=src.system_prompt,
                          settings=deepcopy(src.settings), messages=messages)

    async def _branch_at(self, session: ChatSession, index: int) -> None:
        """A new tab with the messages up to `index`; ending on a question, it is answered there."""
        messages = deepcopy(session.record.messages[:index + 1])
        branch = ChatSession(self._branch_record(session, messages))
        branch.turns = session.turns_before(index + 1)
        self._inherit_pages(branch, branch.previous(index + 1))
        await self._open_session(branch, after=session)
        self._save(branch, messages=True)
        if messages[-1].role == "user" and self.backend is not None:
            await self._start_reply(branch)

    def _inherit_pages(self, branch: ChatSession, turn: Outcome | None) -> None:
        """A branch starts out owning the full pages of the exchange it copies (cached ones, in the map)."""
        block_size = self.backend.info.block_size if self.backend is not None else None
        if turn is not None and turn.pages and block_size:
            branch.pages = turn.pages[:turn.total_tokens // block_size]
            branch.page_tokens = len(branch.pages) * block_size

    async def _fork_live(self, session: ChatSession) -> None:
        """Branch at the reply being written: the backend forks it (locally, sharing its pages copy-on-write)."""
        index = session.reply_index
        remaining = max(1, session.record.settings.max_tokens - session.received_tokens)
        try:
            handle = self.backend.fork(session.handle, session.record.settings.params(max_tokens=remaining),
                                       on_update=self.inbox.callback(""))
        except Exception as exc:
            self.notify(f"Cannot fork this reply ({exc}); branching from the last finished message.",
                        severity="warning")
            await self._branch_at(session, index - 1)
            return
        partial = session.reply_prefix + session.received_text
        messages = deepcopy(session.record.messages[:index]) + [ChatMessage("assistant", partial)]
        branch = ChatSession(self._branch_record(session, messages))
        branch.turns = session.turns_before(index)
        self._track(branch, handle, index, prefix=session.reply_prefix, inheriting=True)
        view = await self._open_session(branch, after=session)
        reply = view.view_at(index)
        if reply is not None:
            reply.set_stats("forked: continuing this reply…")
        self._save(branch, messages=True)

    def copy_message(self, index: int, code: bool = False) -> None:
        session = self.active_session
        if session is None or not 0 <= index < len(session.record.messages):
            return
        message = session.record.messages[index]
        if not code:
            self._copy(message.content, "message")
            return
        blocks = message.code_blocks()
        if not blocks:
            self.notify("This message has no code block.", severity="warning")
        elif len(blocks) == 1:
            self._copy(blocks[0], "code block")
        else:
            options = [(b.strip().splitlines()[0][:60] if b.strip() else "(empty)", b) for b in blocks]
            self.push_screen(PickScreen("Copy which code block?", options),
                             lambda b: b is not None and self._copy(b, "code block"))

    def _copy(self, text: str, what: str) -> None:
        self.copy_to_clipboard(text)
        self.notify(f"Copied the {what} ({len(text)} characters) to the clipboard via OSC 52.", timeout=3)

    def action_export_chat(self) -> None:
        chat_ops.offer_export(self)

    def pick_message(self, title: str, then: Callable[[int], object], role: str | None = None) -> None:
        session = self.active_session
        if session is None or not session.record.messages:
            self.notify("This chat has no messages yet.", severity="warning")
            return
        options = [(f"{i + 1}. {'You' if m.role == 'user' else 'Assistant'}: {title_from(m.content, 50)}", i)
                   for i, m in enumerate(session.record.messages) if role is None or m.role == role]
        if not options:
            self.notify("No message to pick.", severity="warning")
            return
        self.push_screen(PickScreen(title, options), lambda i: i is not None and then(i))

    @on(MessageView.Action)
    async def _message_action(self, event: MessageView.Action) -> None:
        index = event.view.index
        if event.action == "copy":
            self.copy_message(index)
        elif event.action == "copy_code":
            self.copy_message(index, code=True)
        elif event.action == "branch":
            await self.action_branch(index)
        elif event.action == "edit":
            self.edit_message(index)
        elif event.action == "regenerate":
            await self.action_regenerate(index)

    async def action_quit(self) -> None:
        await self.save_all()
        self.exit()

    async def save_all(self) -> None:
        for session in list(self.sessions.values()):
            await self._abandon(session)
        if self.sessions:
            self._save_order()

    def on_unmount(self) -> None:
        self._remove_exit_signals()
        if self.backend is not None:
            self.backend.shutdown()
        if self.store is not None:
            self.saver.retry(BUSY_TIMEOUT_S)  # the last chance: wait as long as any write would
            self.store.close()

    # ---- the backend arriving, and the periodic refresh ------------------------------------------------------
    def _load_bar(self) -> ProgressBar | None:
        """None once the app is closing: a load that ends during shutdown finds no widgets left."""
        bars = self.query("#load-progress")
        return bars.first(ProgressBar) if bars else None

    def on_load_progress(self, event: LoadProgress) -> None:
        bar = self._load_bar()
        if bar is None:
            return
        if event.fraction is None:
            bar.update(total=None)
        else:
            bar.update(total=100, progress=event.fraction * 100)
        self.query_one("#status", Label).update(Content.assemble(("loading ", "$text-muted"),
                                                                 visible_controls(event.stage)))

    def on_engine_ready(self, event: EngineReady) -> None:
        bar = self._load_bar()
        if bar is None:
            event.engine.shutdown()
            return
        self.backend = event.engine
        bar.display = False
        self._update_status()
        for session in self.sessions.values():
            context.show_fill(self, session)
        self._tick(force=True)

    def on_engine_failed(self, event: EngineFailed) -> None:
        self.backend_error = event.error.rstrip(".") + "."
        bar = self._load_bar()
        if bar is None:
            return
        bar.display = False
        self.query_one("#status", Label).update(Content.styled(visible_controls(self.backend_error), "$error"))
        self.query_one(InspectorView).show_message(self.backend_error)
        self.notify(self.backend_error, severity="error", timeout=15)

    def _update_status(self) -> None:
        if self.backend is None:
            return
        if self.backend.failure is not None:
            self.query_one("#status", Label).update(
                Content.styled(visible_controls(f"engine stopped: {self.backend.failure}"), "$error"))
            return
        info = self.backend.info
        busy = sum(1 for s in self.sessions.values() if s.busy)
        pages = f" · {info.num_pages} pages" if info.num_pages else ""
        activity = f" · {busy} generating" if busy else ""
        self.query_one("#status", Label).update(
            Content.assemble((visible_controls(info.model), "bold"),
                             (f" {visible_controls(info.where)}{pages}{activity}", "$text-muted")))

    def chat_pages(self) -> list[ChatPages]:
        return [ChatPages(s.id, s.record.title, self._colour_of(s), s.request_id, s.pages, s.page_tokens)
                for s in self.ordered_sessions()]

    def _tick(self, force: bool = False) -> None:
        """Poll memory while something runs or the inspector is open; note which pages each chat holds."""
        if self.backend is None or not self.is_running or self._note_engine_stopped():
            return
        try:
            inspector = self.query_one(InspectorView)
        except NoMatches:  # shutting down
            return
        busy = [s for s in self.sessions.values() if s.busy]
        if not busy and not inspector.display:
            return
        view = self.backend.memory()
        for session in busy:
            held = request_pages(view, session.request_id)
            if held is not None:
                session.pages, session.page_tokens = held
            context.show_fill(self, session)
        if inspector.display:
            pages = self.chat_pages()
            active = self.active_session
            focused = next((c for c in pages if active and c.chat_id == active.id), None)
            inspector.update_view(view, pages, focused, force=force)

    # ---- the command palette -----------------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        # `screen` is the one the palette opened over (self.screen is the palette itself): chat commands are for
        # the chats' own screen, not over a dialog.
        if screen is not self.screen_stack[0]:
            return
        yield SystemCommand("New chat", "Open a chat in a new tab (ctrl+n)", self.action_new_chat)
        yield SystemCommand("Close chat", "Close this tab; it stays saved and can be reopened (ctrl+w)",
                            self.action_close_chat)
        yield SystemCommand("Next chat", "Switch to the next tab (ctrl+pagedown)", self.action_next_chat)
        yield SystemCommand("Previous chat", "Switch to the previous tab (ctrl+pageup)", self.action_prev_chat)
        yield SystemCommand("Rename chat", "Give this chat a new title (F4)", self.action_rename_chat)
        yield SystemCommand("Chat settings", "System prompt and sampling for this chat (F3)",
                            self.action_chat_settings)
        yield SystemCommand("Memory inspector", "Show or hide the KV-cache page inspector (F2)",
                            self.action_toggle_inspector)
        yield SystemCommand("Help", "Keys, the inspector, where files are kept (F1)", self.action_help)
        if self.backend is not None and self.backend.failure is not None:
            yield SystemCommand("Restart engine",
                                f"The engine stopped ({escaped_markup(self.backend.failure)}); load it again",
                                self.restart_engine)
        yield SystemCommand("Stop reply", "Stop the reply in this tab (Esc)", self._stop_active)
        yield SystemCommand("Regenerate last reply", "Replace the last reply with a new one (ctrl+r)",
                            self.action_regenerate)
        yield SystemCommand("Branch chat at a message…", "Copy the chat up to a message into a new tab",
                            lambda: self.pick_message("Branch at which message?", self._branch_index))
        yield SystemCommand("Branch at the last message", "Branch here; a live reply is forked (ctrl+b)",
                            self.action_branch)
        yield SystemCommand("Edit a message and resend…", "Change one of your messages and reply again",
                            lambda: self.pick_message("Edit which message?", self.edit_message, role="user"))
        yield SystemCommand("Copy last reply", "To the clipboard (OSC 52)", lambda: self._copy_last(False))
        yield SystemCommand("Copy a code block from the last reply", "To the clipboard (OSC 52)",
                            lambda: self._copy_last(True))
        yield SystemCommand("Export chat…", "Markdown, or JSON that imports back, in "
                            f"{escaped_markup(str(self.config.data_dir / 'exports'))} (ctrl+o)",
                            self.action_export_chat)
        for chat_id, title, count in self.store.closed_chats():
            # The palette parses titles as markup.
            yield SystemCommand(f"Reopen chat: {escaped_markup(title)}", f"Closed chat, {count} messages",
                                lambda cid=chat_id: self.reopen_chat(cid), discover=False)

    def _stop_active(self) -> None:
        session = self.active_session
        if session is not None and session.busy:
            session.handle.cancel()

    async def _branch_index(self, index: int) -> None:
        await self.action_branch(index)

    def _copy_last(self, code: bool) -> None:
        session = self.active_session
        if session is None:
            return
        last = next((i for i in range(len(session.record.messages) - 1, -1, -1)
                     if session.record.messages[i].role == "assistant"), None)
        if last is None:
            self.notify("No reply to copy yet.", severity="warning")
        else:
            self.copy_message(last, code=code)


def binding_catalogue() -> list[Binding]:
    """Every remappable binding, for the keymap check and the help screen."""
    out = []
    for cls in (PagedChatApp, ChatView, PromptInput, MessageView):
        out += [b for b in cls.BINDINGS if isinstance(b, Binding) and b.id]
    return out


def run_app(config: AppConfig, *, backend_factory: BackendFactory | None = None) -> None:
    """Run the chat app until the user quits (the CLI's entry point)."""
    app = PagedChatApp(config, backend_factory=backend_factory)
    app.run()
    if app.saver is not None and app.saver.pending:  # the last save at exit failed too: say so, not silently
        print(f"pagedchat: the latest changes could not be saved ({app.saver.failing})", file=sys.stderr)
