"""The pagedchat app: chat tabs over one backend, streaming replies, the memory inspector, saved chats.

The App routes: keys, the palette (commands.py) and backend updates go to the chat they concern, a ChatView
(chat_view.py) that owns its reply (reply.py) and its actions; the tabs (tabs.py) open, show and close chats;
the backend link (backend_link.py) loads the backend and polls its memory.

Threads: the backend streams on its own thread and hands updates to UpdateInbox, which wakes the UI with one
UpdatesReady message at a time; the backend starts (model load, or server connect) on a daemon thread.
Everything else, including SQLite writes (a few ms, when a chat changes and twice a second per streaming
reply), runs on Textual's event loop, so no widget is ever touched off-thread. Everything that changes a chat
(a key binding, wherever it is declared, and a batch of updates) runs on the App's own message loop, one at a
time. What is saved when is marked through a Saver.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Callable

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.widgets import Footer, TabbedContent

from pagedchat.backends.base import Backend
from pagedchat.backends.open import open_backend
from pagedchat.config import DEFAULT_THEME, AppConfig, binding_problem
from pagedchat.text import visible_controls
from pagedchat.tui import chat_ops
from pagedchat.tui.backend_link import BackendFactory, BackendLink, StatusBar
from pagedchat.tui.bridge import UpdateInbox, UpdatesReady, EngineFailed, EngineReady, LoadProgress
from pagedchat.tui.chat_widgets import MessageView, PromptInput, action_name
from pagedchat.tui.chat_view import ChatView
from pagedchat.tui.commands import AppCommands
from pagedchat.tui.history import PromptHistory
from pagedchat.tui.inspector import InspectorView
from pagedchat.tui.conversation import ChatRecord, ChatSettings
from pagedchat.tui.saver import RETRY_S, Saver
from pagedchat.tui.screens.compare import CompareScreen, start_compare
from pagedchat.tui.screens.help import HelpScreen
from pagedchat.tui.screens.modals import UnsavedQuitScreen
from pagedchat.tui.session import ChatSession
from pagedchat.tui.store import BUSY_TIMEOUT_S, Store
from pagedchat.tui.tabs import ChatTabs, TabHooks
from pagedchat.tui.terminal import install_exit_signals, remove_exit_signals, terminal_driver
from pagedchat.tui.themes import load_themes

TICK_S = 0.25          # inspector refresh and page-ownership polling
DRAFT_S = 2.0          # each chat's unsent input is saved this often, if it changed
RECONNECT_S = 3.0      # a server that could not be reached is tried again this often, in the background


def default_backend_factory(config: AppConfig) -> BackendFactory:
    """The server named by --server / `server =`, else the engine in a process of its own, so that drawing
    never holds up a step (backends/process.py). Every core computes: the UI needs little CPU between steps, and
    leaving it a core made streaming slower for less timer jitter (docs/bench.md#a-core-for-the-event-loop)."""
    return lambda progress: open_backend(config, progress, own_process=os.name == "posix")  # pass_fds: POSIX


class PagedChatApp(App):
    CSS_PATH = "pagedchat.tcss"
    TITLE = "pagedchat"
    COMMANDS = App.COMMANDS | {AppCommands}   # every pagedchat command (tui/commands.py)

    # Priority: the app's keys work whatever has focus, and a key remapped in config.toml onto one the TextArea
    # also uses (it takes f6/f7, ctrl+w, ...) still reaches the app. F3, F4, ctrl+r and ctrl+b act on the chat in
    # view, but are the app's for that reason: they work with the keyboard in the inspector or on the tab strip.
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
        self.link = BackendLink(self, backend_factory or default_backend_factory(config),
                                reconnect_s=RECONNECT_S if config.server else None)
        self.inbox = UpdateInbox(self)
        self.store: Store | None = None
        self.saver: Saver | None = None
        self.chats: ChatTabs | None = None
        self._exiting = False                          # a signal: no more updates are taken
        self._focus_before_inspector = None            # where F2 found the keyboard, to give it back
        self._startup_notes: list[tuple[str, str]] = []
        self.applied_keys: dict[str, str] = {}         # config.toml's [keys] that were taken (_apply_keymap)
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

    def action_help_quit(self) -> None:
        """ctrl+c outside a text field: Textual's hint, whose "[b]…[/b]" is markup this app's notify() shows as
        typed."""
        name = action_name(self.action_quit)
        quit_keys = [key for key, active in self.active_bindings.items()
                     if active.binding.action in (name, f"app.{name}")]
        if quit_keys:
            self.notify(f"Press {quit_keys[0]} to quit the app.", title="Do you want to quit?")

    # ---- what the palette, the chat operations and the screens see ----------------------------------------
    @property
    def backend(self) -> Backend | None:
        return self.link.backend

    @property
    def tabs(self) -> TabbedContent:
        return self.query_one("#chats", TabbedContent)

    @property
    def sessions(self) -> dict[str, ChatSession]:
        return self.chats.sessions if self.chats is not None else {}

    @property
    def active_session(self) -> ChatSession | None:
        return self.chats.active if self.chats is not None else None

    def chat_view(self, session: ChatSession) -> ChatView | None:
        return self.chats.view(session)

    @property
    def active_chat(self) -> ChatView | None:
        session = self.active_session
        return self.chats.view(session) if session is not None else None

    # ---- layout, theme, keymap ---------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield TabbedContent(id="chats")
            yield InspectorView(id="inspector")
        yield StatusBar("connecting to the server…" if self.config.server else "loading the model…", id="statusbar")
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        self.store = self._open_store()
        self.saver = Saver(self.store, lambda text, severity: self.notify(text, severity=severity, timeout=10))
        install_exit_signals(self._exit_on_signal)
        self.prompt_history = PromptHistory(self.store.recent_prompts())
        hooks = TabHooks(self._new_record, lambda: self.theme_variables, self._chat_changed,
                         lambda: self.refresh_memory(force=True))
        self.chats = ChatTabs(self.tabs, self.link, self.saver, self.inbox, self.prompt_history, hooks)
        self._apply_theme()
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        self._apply_keymap()
        await self.chats.restore(self.store.load_chats(open_only=True), self.store.get_state("active_chat"))
        drafts = self.store.drafts()
        for view in self.chats.views():
            self._restore_draft(view, drafts)
        for text, severity in self._startup_notes:
            self.notify(text, severity=severity, timeout=10)
        self.link.start()
        self.set_interval(TICK_S, self.refresh_memory)
        self.set_interval(RETRY_S, self.saver.retry)  # a no-op unless a write failed
        self.set_interval(DRAFT_S, self.keep_drafts)

    def _open_store(self) -> Store:
        try:
            store = self._open_store_at(self.config.data_dir)
        except OSError as exc:
            store = Store.in_memory(f"Cannot write saved chats in {self.config.data_dir} ({exc.strerror or exc}); "
                                    "chats in this session will not be kept.")
        if store.notice:
            self._startup_notes.append((store.notice, "error"))
        return store

    def _new_record(self) -> ChatRecord:
        return ChatRecord(system_prompt=self.config.system_prompt,
                          settings=ChatSettings.from_defaults(self.config.sampling))

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
            self.chats.refresh_label(session)
        self.refresh_memory(force=True)

    def _apply_keymap(self) -> None:
        """config.toml's [keys] over the bindings. An unknown id, or keys Textual never reports, is a warning,
        and that binding keeps its default key."""
        known = {b.id: b for b in binding_catalogue() if b.id}
        if unknown := sorted(set(self.config.keys) - set(known)):
            self._startup_notes.append((f"config.toml [keys]: unknown binding id {', '.join(unknown)} "
                                        "(F1 lists them)", "warning"))
        problems = {i: binding_problem(keys) for i, keys in self.config.keys.items() if i in known}
        for i, problem in problems.items():
            if problem is not None:
                self._startup_notes.append((f"config.toml [keys] {i} ({known[i].description or known[i].action}) "
                                            f"= {self.config.keys[i]!r}: {problem}; it stays on {known[i].key}",
                                            "warning"))
        self.applied_keys = {i: self.config.keys[i] for i, problem in problems.items() if problem is None}
        self.set_keymap(self.applied_keys)

    # ---- routing to the chats ------------------------------------------------------------------------------
    @on(TabbedContent.TabActivated, "#chats")
    async def _tab_activated(self) -> None:
        await self.chats.activated(self.active_session)

    async def on_updates_ready(self, _: UpdatesReady) -> None:
        batches: dict[str, list] = {}
        for _chat_id, update in self.inbox.take():
            batches.setdefault(update.request_id, []).append(update)
        for request_id, updates in batches.items():
            view = None if self._exiting else self.chats.view_for_request(request_id)
            if view is not None:  # else a closed chat or an abandoned reply: the backend was told to cancel it
                await view.take(updates)
        if not self._exiting:
            self.chats.snapshot_replies()
        self.saver.flush()

    def _chat_changed(self, session: ChatSession) -> None:
        self.link.show_status(self.chats.generating())
        self.refresh_memory()  # the inspector shows a chat idle at once, not a tick later as "queued"
        self.refresh_bindings()

    # ---- the chat in view's keys: the same ChatView methods the palette calls -------------------------------
    def action_chat_settings(self) -> None:
        if (chat := self.active_chat) is not None:
            chat.settings()

    def action_rename_chat(self) -> None:
        if (chat := self.active_chat) is not None:
            chat.rename()

    async def action_regenerate(self) -> None:
        if (chat := self.active_chat) is not None:
            await chat.regenerate()

    async def action_branch(self) -> None:
        if (chat := self.active_chat) is not None:
            await chat.branch()

    # ---- app-wide actions -----------------------------------------------------------------------------------
    async def action_new_chat(self) -> None:
        await self.chats.new_chat()

    async def action_close_chat(self) -> None:
        session = self.active_session
        if session is None:
            return
        await self.active_chat.abandon()
        self.saver.draft(session.record, self.active_chat.prompt.text)
        session.record.is_open = False
        self.active_chat.save(row=True)
        await self.chats.remove(session)
        self.notify(f"Closed “{session.record.title}”; reopen it from the command palette.", timeout=4)

    async def reopen_chat(self, chat_id: str) -> None:
        if chat_id in self.sessions:
            return
        await self.chats.reopen(next((r for r in self.store.load_chats(open_only=False) if r.id == chat_id), None))
        if (session := self.sessions.get(chat_id)) is not None:
            self._restore_draft(self.chat_view(session), self.store.drafts())

    def _restore_draft(self, view: ChatView, drafts: dict[str, str]) -> None:
        if text := drafts.get(view.chat_id):
            view.prompt.text = text
            view.prompt.move_cursor(view.prompt.document.end)
            self.saver.draft(view.session.record, text, saved=True)

    def keep_drafts(self) -> None:
        """Each chat's unsent input that changed, marked and written (every DRAFT_S, and on the way out)."""
        for view in self.chats.views():
            for prompt in view.query(PromptInput).results(PromptInput):   # none while the view is still mounting
                self.saver.draft(view.session.record, prompt.text)
        self.saver.flush()

    def action_next_chat(self) -> None:
        self.chats.switch(1)

    def action_prev_chat(self) -> None:
        self.chats.switch(-1)

    def action_delete_chat(self) -> None:
        chat_ops.confirm_delete(self)

    def action_compare(self) -> None:
        start_compare(self)

    def action_export_chat(self) -> None:
        chat_ops.offer_export(self)

    def action_toggle_inspector(self) -> None:
        if isinstance(self.screen, CompareScreen):   # it has an inspector of its own, for its two requests
            self.screen.toggle_inspector()
            return
        inspector = self.query_one(InspectorView)
        if not inspector.display:
            self._focus_before_inspector = self.focused
        elif self.focused is None or inspector in (self.focused, *self.focused.ancestors):
            # Hidden with the keyboard inside it (Tab, to scroll it): focus would be nowhere, and neither typing
            # nor Esc (stop the reply) would reach the chat. It goes back where it was, or to the input.
            self._refocus(self._focus_before_inspector)
        inspector.display = not inspector.display
        self.refresh_memory(force=True)

    def _refocus(self, widget) -> None:
        if widget is not None and widget.is_attached and widget.focusable:
            widget.focus()
        elif (chat := self.active_chat) is not None:
            chat.prompt.focus()

    def action_help(self) -> None:
        rows = [(self.applied_keys.get(b.id, b.key), b.description or b.action, b.id) for b in binding_catalogue()]
        paths = (f"## Files\n\n* Saved chats: `{self.store.path}`\n* Exports: `{self.config.data_dir / 'exports'}`\n"
                 f"* Config: `{self.config.config_dir / 'config.toml'}`\n"
                 f"* Your themes: `{self.config.user_theme_dir}/*.toml`")
        self.push_screen(HelpScreen(rows, paths))

    async def action_quit(self) -> None:
        """Quit once everything is saved. Chats that cannot be written (a full disk) are not dropped silently:
        the user is asked, while the retries go on, and a retry that succeeds meanwhile quits."""
        if isinstance(self.screen, UnsavedQuitScreen):
            return
        await self.save_all()
        if self.saver.retry(BUSY_TIMEOUT_S) or not self.saver.unsaved_chats():  # else only tab order or theme
            self.exit()
            return
        ask = UnsavedQuitScreen(self.saver, Path.home() / "pagedchat-unsaved")
        self.push_screen(ask, lambda answer: answer is not None and self.exit(ask.exported))

    async def save_all(self) -> None:
        for view in self.chats.views():
            await view.abandon()
        if self.sessions:
            self.chats.save_order()
        self.keep_drafts()

    # ---- signals and the end ----------------------------------------------------------------------------------
    def get_driver_class(self):
        return terminal_driver(super().get_driver_class())   # one that survives its terminal's hang-up

    def _exit_on_signal(self) -> None:
        """SIGTERM, or SIGHUP (the terminal closed): save each live reply as it stands, marked interrupted
        (it did not finish, and nobody stopped it), and exit. Saved first: a closed terminal may not let the
        exit finish. Its last updates are not waited for."""
        self._exiting = True
        for view in self.chats.views():
            view.save_interrupted()
        self.keep_drafts()
        self.saver.retry(BUSY_TIMEOUT_S)  # even while writes fail: this is the last chance
        self.exit()

    def on_unmount(self) -> None:
        gc.unfreeze()   # what BackendLink.arrived froze: another app in this process (tests) must not leak it
        remove_exit_signals()
        if self.backend is not None:
            self.backend.shutdown()
        if self.store is not None:
            self.saver.retry(BUSY_TIMEOUT_S)  # the last chance: wait as long as any write would
            self.store.close()

    # ---- the backend arriving, and the periodic refresh ----------------------------------------------------------
    def on_load_progress(self, event: LoadProgress) -> None:
        self.link.progress(event.stage, event.fraction)

    def on_engine_ready(self, event: EngineReady) -> None:
        if not self.link.arrived(event.engine):
            return
        self.link.show_status(self.chats.generating())
        for view in self.chats.views():
            view.show_fill()
        self.refresh_memory(force=True)

    def on_engine_failed(self, event: EngineFailed) -> None:
        self.link.failed(event.error)

    def refresh_memory(self, force: bool = False) -> None:
        """The inspector and each busy chat's pages, from the backend's memory view (every TICK_S)."""
        if self.chats is None or not self.is_running:
            return
        try:
            inspector = self.query_one(InspectorView)
        except NoMatches:  # shutting down
            return
        self.link.poll(self.chats, inspector, force=force)


def binding_catalogue() -> list[Binding]:
    """Every remappable binding, for the keymap check and the help screen."""
    out = []
    for cls in (PagedChatApp, ChatView, PromptInput, MessageView):
        out += [b for b in cls.BINDINGS if isinstance(b, Binding) and b.id]
    return out


def run_app(config: AppConfig, *, backend_factory: BackendFactory | None = None) -> None:
    """Run the chat app until the user quits (the CLI's entry point)."""
    app = PagedChatApp(config, backend_factory=backend_factory)
    exported = app.run() or []   # the unsaved chats' files, where the user exported them at quit
    if app.saver is not None and app.saver.pending:  # the last save at exit failed too: say so, not silently
        print(f"pagedchat: the latest changes could not be saved ({app.saver.failing})", file=sys.stderr)
    for path in exported:
        print(visible_controls(f"pagedchat: exported {path}; `pagedchat import` brings it back"), file=sys.stderr)
