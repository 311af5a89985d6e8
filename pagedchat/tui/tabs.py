"""The open chats: one tab each, in the order shown, which one is active, their labels and colours.

Every chat is opened, shown and closed through `ChatTabs`, so one reached from search, import, compare or a
branch behaves like one opened with ctrl+n.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from textual.content import Content
from textual.widgets import TabbedContent, TabPane

from pagedchat.text import visible_controls
from pagedchat.tui.backend_link import BackendLink
from pagedchat.tui.bridge import UpdateInbox
from pagedchat.tui.chat_widgets import MessageView
from pagedchat.tui.chat_view import SAVE_EVERY_S, ChatServices, ChatView
from pagedchat.tui.history import PromptHistory
from pagedchat.tui.inspector import ChatPages
from pagedchat.tui.conversation import ChatRecord
from pagedchat.tui.saver import Saver
from pagedchat.tui.session import ChatSession
from pagedchat.tui.themes import chat_colour

PANE_PREFIX = "chat-"


@dataclass(frozen=True)
class TabHooks:
    """What the tabs ask of the app: a fresh chat's record, its theme, and a refresh of what depends on chats."""

    new_record: Callable[[], ChatRecord]
    theme_variables: Callable[[], dict[str, str]]
    changed: Callable[[ChatSession], None]      # a chat started or stopped replying
    refresh: Callable[[], None]                 # after a switch: the memory view


class ChatTabs:
    def __init__(self, tabbed: TabbedContent, link: BackendLink, saver: Saver, inbox: UpdateInbox,
                 history: PromptHistory, hooks: TabHooks) -> None:
        self.tabbed = tabbed
        self.saver = saver
        self.hooks = hooks
        self.sessions: dict[str, ChatSession] = {}
        self.services = ChatServices(link, saver, inbox, history, open_chat=self.open, is_open=self.is_open,
                                     active=lambda: self.active, changed=self._changed)

    def is_open(self, chat_id: str) -> bool:
        return chat_id in self.sessions

    @property
    def active(self) -> ChatSession | None:
        pane = self.tabbed.active
        return self.sessions.get(pane[len(PANE_PREFIX):]) if pane else None

    def view(self, session: ChatSession) -> ChatView | None:
        try:
            return self.tabbed.get_pane(PANE_PREFIX + session.id).query_one(ChatView)
        except Exception:
            return None

    def views(self) -> list[ChatView]:
        """Every open chat's view that is mounted with its children: a chat opened a moment ago may be in the
        DOM before its compose has run, and its input is not there to touch yet."""
        return [view for session in list(self.sessions.values())
                if (view := self.view(session)) is not None and view.is_mounted]

    def view_for_request(self, request_id: str) -> ChatView | None:
        """The chat whose live reply this request writes, if it still takes updates (not closed or abandoned)."""
        session = next((s for s in self.sessions.values() if s.reply.takes(request_id)), None)
        return self.view(session) if session is not None else None

    def ordered(self) -> list[ChatSession]:
        tabs = self.tabbed.query("ContentTab")
        ids = [t.id.removeprefix("--content-tab-").removeprefix(PANE_PREFIX) for t in tabs if t.id]
        return [self.sessions[i] for i in ids if i in self.sessions]

    def generating(self) -> int:
        return sum(1 for s in self.sessions.values() if s.busy)

    def snapshot_replies(self) -> None:
        """Mark every live reply's snapshot for the next write once the oldest is SAVE_EVERY_S old: all the
        tabs' replies then go in one transaction, not one each at its own moment. A commit waits on the disk
        (fsyncs) on the UI thread, and a key typed meanwhile waits with it."""
        live = [s for s in self.sessions.values() if s.reply.taking and s.reply.index is not None]
        if not live or time.monotonic() - min(s.reply.saved_at for s in live) < SAVE_EVERY_S:
            return
        for session in live:
            if (view := self.view(session)) is not None:
                view.save_reply()

    async def restore(self, records: list[ChatRecord], active_id: str | None) -> None:
        for record in records:
            await self.open(ChatSession(record), activate=False)
        if not records:
            await self.new_chat()
            return
        if active_id in self.sessions:
            self.show(self.sessions[active_id])
        await self.activated(self.active)

    async def new_chat(self) -> None:
        session = ChatSession(self.hooks.new_record())
        self.saver.chat(session.record, messages=True)
        await self.open(session, after=self.active)

    async def open(self, session: ChatSession, *, after: ChatSession | None = None,
                   activate: bool = True) -> ChatView:
        used = {s.colour for s in self.sessions.values()}
        session.colour = next(i for i in range(len(used) + 1) if i not in used)
        self.sessions[session.id] = session
        view = ChatView(session, self.services)
        pane = TabPane(self.label(session), view, id=PANE_PREFIX + session.id)
        await self.tabbed.add_pane(pane, after=(PANE_PREFIX + after.id) if after else None)
        if activate:
            self.show(session)
            await self.activated(session)
        self.save_order()
        return view

    async def reopen(self, record: ChatRecord | None) -> None:
        """A closed chat's tab again (nothing if it is gone, or open already)."""
        if record is not None and record.id not in self.sessions:
            record.is_open = True
            (await self.open(ChatSession(record), after=self.active)).save(row=True)

    async def remove(self, session: ChatSession) -> None:
        """Close the chat's tab (its live reply is abandoned first); a last tab closed leaves a new chat."""
        if (view := self.view(session)) is not None:
            await view.abandon()
        del self.sessions[session.id]
        await self.tabbed.remove_pane(PANE_PREFIX + session.id)
        if not self.sessions:
            await self.new_chat()
        else:
            await self.activated(self.active)
        self.save_order()

    def show(self, session: ChatSession) -> None:
        """Bring a chat's tab forward. Focus leaves the old tab first: a focused widget in a pane being hidden
        hands focus to a sibling in that same pane, and TabbedContent then switches straight back to it."""
        if self.tabbed.active != PANE_PREFIX + session.id:
            self.tabbed.screen.set_focus(None)
            self.tabbed.active = PANE_PREFIX + session.id

    def switch(self, step: int) -> None:
        sessions = self.ordered()
        current = self.active
        if current in sessions and len(sessions) > 1:
            self.show(sessions[(sessions.index(current) + step) % len(sessions)])

    async def activated(self, session: ChatSession | None) -> None:
        if session is None:
            return
        session.unseen = False
        for each in self.sessions.values():   # the tab left behind may be generating: its mark comes back
            self.refresh_label(each)
        view = self.view(session)
        if view is not None:
            await view.populate()
            focused = self.tabbed.app.focused
            if not isinstance(focused, MessageView) or focused not in view.views:
                # At once: focus() waits behind the keys queued meanwhile (typed just after ctrl+n), and
                # with nothing focused they would be lost.
                view.prompt.screen.set_focus(view.prompt)
            view.show_fill()
        self.saver.state("active_chat", session.id)
        self.saver.flush()
        self.hooks.refresh()

    def save_order(self) -> None:
        sessions = self.ordered()
        for i, s in enumerate(sessions):
            s.record.position = i
        self.saver.order([s.id for s in sessions])
        self.saver.flush()

    def colour_of(self, session: ChatSession) -> str:
        return chat_colour(self.hooks.theme_variables(), session.colour)

    def label(self, session: ChatSession) -> Content:
        parts: list = [("■", self.colour_of(session)), " ", visible_controls(session.record.title)]
        if session.busy and session is not self.active:
            parts.append((" ●", "$warning"))   # generating, seen from the other tabs (in view, the reply says so)
        elif session.unseen:
            parts.append((" ●", "$success"))   # a reply finished while the tab was not in view
        return Content.assemble(*parts)

    def refresh_label(self, session: ChatSession) -> None:
        try:
            self.tabbed.get_tab(PANE_PREFIX + session.id).label = self.label(session)
        except Exception:  # the tab is being removed
            pass

    def chat_pages(self) -> list[ChatPages]:
        return [ChatPages(s.id, s.record.title, self.colour_of(s), s.reply.request_id, s.pages, s.page_tokens)
                for s in self.ordered()]

    def _changed(self, session: ChatSession) -> None:
        self.refresh_label(session)
        self.hooks.changed(session)
