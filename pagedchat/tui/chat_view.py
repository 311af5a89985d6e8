"""A chat tab: its log of messages and its input, and everything done to one chat.

The app routes its keys for the chat in view (F3, F4, ctrl+r, ctrl+b), the palette and backend updates to the
active or the addressed ChatView, which owns the rest: its own keys (Enter, Esc, alt+up) and its messages'
(MessageActions), sending, its Reply's life on screen and on disk, regenerating, editing, branching and
forking, copying, renaming and settings. What it needs from the app comes in as ChatServices, never read off it.
"""

from __future__ import annotations

import time
from copy import deepcopy
from dataclasses import dataclass
from typing import Awaitable, Callable

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical

from pagedchat.backends.base import Backend, refusal
from pagedchat.engine.records import FinishReason, Outcome, Update
from pagedchat.tui import context, copying, refused
from pagedchat.tui.backend_link import BackendLink
from pagedchat.tui.bridge import UpdateInbox
from pagedchat.tui.chat_widgets import MessageView, PromptInput, action_name
from pagedchat.tui.history import PromptHistory
from pagedchat.tui.message_list import MessageList
from pagedchat.tui.conversation import ChatMessage, title_from
from pagedchat.tui.reply import Ending
from pagedchat.tui.saver import Saver
from pagedchat.tui.screens.ask import RenameScreen
from pagedchat.tui.screens.modals import ChatSettingsScreen, EditMessageScreen
from pagedchat.tui.session import ChatSession, branch_record, inherited_pages

SAVE_EVERY_S = 0.5     # a streaming reply is saved this often, so a crash loses under a second of it
BUSY_NOTICE = "This chat is still replying: wait, or press Esc to stop it."


@dataclass(frozen=True)
class ChatServices:
    """What a chat needs from the app around it."""

    link: BackendLink
    saver: Saver
    inbox: UpdateInbox
    history: PromptHistory
    open_chat: Callable[..., Awaitable[ChatView]]      # open_chat(session, after=...): a new tab, shown
    is_open: Callable[[str], bool]                     # the chat (by id) still has its tab
    active: Callable[[], ChatSession | None]
    changed: Callable[[ChatSession], None]             # it started or stopped replying


class ChatView(Vertical):
    """A chat tab's content. Messages are mounted on first show, so restoring many chats stays quick, and only
    those around what is on screen (message_list.py), so a long chat opens as quickly as a short one."""

    # Enter is the chat's binding: the input lets it pass (after every key typed before it, so a fast typist's or
    # a paste's last characters are sent too), and the action runs on the app's message loop, as every other
    # change to a chat does, so sending never interleaves with a reply's updates.
    BINDINGS = [
        Binding("enter", "send", "Send", show=False),
        Binding("escape", "stop", "Stop", id="stop"),
        Binding("alt+up", "focus_message(-1)", "Messages", show=False, id="focus_messages"),
    ]

    def __init__(self, session: ChatSession, services: ChatServices, **kwargs) -> None:
        super().__init__(**kwargs)
        self.session = session
        self.services = services
        self.populated = False
        self._fill_at = 0.0     # when the context figure last changed

    @property
    def chat_id(self) -> str:
        return self.session.id

    @property
    def backend(self) -> Backend | None:
        return self.services.link.backend

    # ---- the log and the input --------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield MessageList(lambda: self.session.record.messages, self._make_view, lambda: self.prompt.focus(),
                          classes="log")
        yield PromptInput(classes="prompt")

    def on_mount(self) -> None:
        self.log_view.anchor()  # stay at the bottom as replies grow, until the user scrolls up

    @property
    def log_view(self) -> MessageList:
        return self.query_one(MessageList)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def views(self) -> list[MessageView]:
        """The mounted messages' views: those around what is on screen."""
        return self.log_view.views

    def _make_view(self, message: ChatMessage, index: int) -> MessageView:
        live, cores = self.session.reply, self.services.link   # the live reply's view, mounted again, streams on
        return MessageView(message, index, self, streamed=live.tokens if index == live.index else None, cores=cores)

    async def populate(self) -> None:
        if self.populated:
            return
        self.populated = True
        await self.log_view.show_last()

    async def add_message(self, message: ChatMessage, index: int) -> MessageView:
        await self.populate()
        view = await self.log_view.append(message, index)
        self.log_view.anchor()  # a new message always brings the view back to the bottom
        return view

    async def truncate(self, count: int) -> None:
        """Remove the views of messages from index `count` on."""
        await self.populate()
        await self.log_view.cut(count)

    def view_at(self, index: int | None) -> MessageView | None:
        return log.view_at(index) if (log := MessageList.child_of(self)) is not None else None

    async def focus_message(self, index: int) -> None:
        messages = self.session.record.messages
        if not messages:
            return
        if self.focused_message is None:  # from the input: alt+up goes to the last message
            index = len(messages) - 1
        elif index >= len(messages):
            self.prompt.focus()
            return
        if (view := await self.log_view.reveal(max(0, index))) is not None:
            view.focus(scroll_visible=False)
            # Once a view mounted just now is laid out (and the list has kept its place): else it has no place.
            self.log_view.call_after_refresh(view.scroll_visible, animate=False)

    async def action_focus_message(self, delta: int) -> None:
        current = self.focused_message
        await self.focus_message(len(self.session.record.messages) - 1 if current is None else current.index + delta)

    @property
    def focused_message(self) -> MessageView | None:
        focused = self.app.focused
        return focused if isinstance(focused, MessageView) and focused in self.views else None

    @on(PromptInput.Recall)
    def _recall(self, event: PromptInput.Recall) -> None:
        event.stop()
        self.services.history.step(event.prompt, event.step)

    async def action_stop(self) -> None:
        """Esc: stop the live reply (the footer offers it only then); on a message with none live, back to the
        input. An engine that is not answering sends no final update: the reply ends here, kept as it stands."""
        if not self.session.busy:
            self.prompt.focus()
        elif self.backend is not None and self.backend.stalled_for() is not None:
            await self.abandon()
        else:
            self.stop()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # Esc shows as "Stop" in the footer only while this chat is replying.
        return self.session.busy if action == action_name(ChatView.action_stop) else True

    def show_fill(self, every: float = 0.0) -> None:
        """The chat's context figure on its input's bottom border, changed at most once in `every` seconds."""
        content = None if time.monotonic() - self._fill_at < every else context.fill(self.session, self.backend)
        if content is not None and content != self.prompt.border_subtitle:  # setting it repaints the input
            self.prompt.border_subtitle, self._fill_at = content, time.monotonic()

    # ---- saving -------------------------------------------------------------------------------------------
    def save(self, *indexes: int, row: bool = False, messages: bool = False) -> None:
        """Save what changed: messages at `indexes`, the chat's row, or (messages=True) all of it. A live
        reply is saved as its snapshot, marked interrupted until it finishes."""
        record, reply = self.session.record, self.session.reply
        if row or messages:
            self.services.saver.chat(record, messages=messages)
        for index in indexes:
            self.services.saver.message(record, index)
        if reply.live and reply.index is not None and (messages or reply.index in indexes):
            self.save_reply()
        self.services.saver.flush()

    def save_reply(self) -> None:
        reply = self.session.reply
        self.services.saver.message(self.session.record, reply.index,
                                    reply.snapshot(self.session.record.messages[reply.index]))
        reply.saved_at = time.monotonic()

    # ---- sending and the reply's life -----------------------------------------------------------------------
    async def action_send(self) -> None:
        """Enter in the input sends its text; Enter on a message does nothing."""
        prompt, text = self.prompt, self.prompt.text
        if self.app.focused is not prompt or not text.strip():
            return
        if self.session.busy:
            self.notify(BUSY_NOTICE, severity="warning")
            return
        if self.services.link.ready_or_say() is None:
            return
        if await self.start_reply(ask=text):
            prompt.clear()  # only now: a message refused at once stays in the input (a later refusal puts it back)
            self.services.history.add(text)
            self.services.history.forget_walk(prompt)

    async def start_reply(self, keep: int | None = None, ask: str | None = None) -> bool:
        """Ask for a reply to the chat's first `keep` messages (default all; the last is the user's), followed
        by `ask` if given. Messages from `keep` on (a reply being regenerated, a message being edited and what
        followed it) go at once; a refusal puts them back (refused.py). True if the reply started."""
        backend = self.services.link.ready_or_say()
        if backend is None:
            return False
        session, record = self.session, self.session.record
        keep = len(record.messages) if keep is None else keep
        conversation = record.conversation(keep) + ([{"role": "user", "content": ask}] if ask is not None else [])
        try:
            handle = backend.submit(conversation, record.settings.params(), previous=session.previous(keep),
                                    on_update=self.services.inbox.callback(session.id))
        except Exception as exc:  # known without asking the engine (it stopped): keep the chat
            self.notify(f"Cannot send: {exc}", severity="error", timeout=10)
            return False
        # The record changes in one go (no await between the cut and the new messages), then the screen.
        replaced = session.replacing(keep, ask)
        self._drop(keep)
        if ask is not None:
            if not record.messages and record.title == "New chat":
                record.title = title_from(ask)
            record.messages.append(ChatMessage("user", ask))
        record.messages.append(ChatMessage("assistant", ""))
        index = len(record.messages) - 1
        session.reply.start(handle, index, replaced=replaced)
        self.services.changed(session)
        self.save(*range(keep, index + 1), row=True)
        await self.truncate(keep)
        for i in range(keep, index + 1):
            view = await self.add_message(record.messages[i], i)
        await view.start_stream()
        return True

    async def take(self, updates: list[Update]) -> None:
        """A batch of the live reply's updates, in order."""
        reply = self.session.reply
        fed = reply.feed(updates)
        view = self.view_at(reply.index)
        if fed.inherited is not None and view is not None:
            await view.start_stream(reply.prefix)  # a fork: its text so far is the parent's up to the fork point
        for notice in fed.notices:
            self.notify(notice, severity="warning", timeout=8)
        self.session.record.messages[reply.index].content = reply.content
        if fed.outcome is not None:
            error = refusal(reply.handle)   # taken, then refused: the chat goes back as it was
            await (self._finish(fed.outcome) if error is None else refused.put_back(self, error))
            return
        if view is not None:
            view.feed(fed.text, fed.tokens)

    async def _finish(self, outcome: Outcome) -> None:
        """The final update: render the whole reply once, record its outcome and stats, then mark the chat idle."""
        session = self.session
        ending = session.reply.finish(outcome)
        if outcome.finish_reason is not FinishReason.ERROR:
            session.turns[ending.index] = outcome
        else:
            kept = "The text so far is kept; " if ending.content else ""
            self.notify(f"The reply failed: {outcome.error}. {kept}ctrl+r asks again.", severity="error", timeout=10)
        # The final block table: the inspector colours this idle chat's cached pages by it.
        if outcome.pages:
            session.pages, session.page_tokens = outcome.pages, outcome.total_tokens
        elif not session.pages:
            session.page_tokens = outcome.total_tokens  # a backend that shows no pages: tokens, for estimates
        # Kept even when nothing came (Esc before the first token, a server gone): its stats line says so, and
        # the next message does not follow the question as a second user turn in a row.
        await self._show_ending(ending)
        # Only now is the chat idle: anything that waits on `busy` sees the finished reply on screen.
        session.reply.end()
        if session is not self.services.active():
            session.unseen = True
        self.services.changed(session)
        self.save(ending.index)
        self.show_fill()
        if outcome.finish_reason is FinishReason.CONTEXT_FULL:
            self.notify(context.CONTEXT_FULL, severity="warning", timeout=10)

    async def _show_ending(self, ending: Ending) -> None:
        message = self.session.record.messages[ending.index]
        message.content, message.stats = ending.content, ending.stats
        if (view := self.view_at(ending.index)) is not None:
            await view.finish(ending.content, ending.stats)

    async def abandon(self) -> None:
        """Stop a reply now, without waiting for the backend's final update (closing, quitting, editing)."""
        reply = self.session.reply
        if not reply.live:
            return
        ending = reply.abandon(self.session.record.messages[reply.index].content)
        await self._show_ending(ending)
        reply.end()
        self.services.changed(self.session)
        self.save(ending.index)

    def stop(self) -> None:
        """Cancel the live reply; its final update arrives as CANCELLED with its stats."""
        if self.session.busy:
            self.session.reply.handle.cancel()

    def save_interrupted(self) -> None:
        """The app is going (a signal): save the live reply as it stands, and wait for no more of it."""
        if self.session.busy:
            self.save_reply()
            self.session.reply.stop_taking()

    def _drop(self, count: int) -> None:
        """Messages from `count` on leave the record and the disk (the screen follows with truncate())."""
        if dropped := self.session.truncate(count):
            self.services.saver.removed(self.session.record, dropped)

    # ---- per-chat actions ------------------------------------------------------------------------------------
    # An action on a message that writes a new reply or opens a new chat ends the walk: the keyboard goes back
    # to an input, so what is typed next is text, not more one-letter actions.
    async def branch_from(self, index: int) -> None:
        await self.branch(index)
        # Not before: a focus queued on this input would land after the branch's tab shows, and pull it back.
        if self.services.active() is self.session:
            self.prompt.focus()

    async def regenerate_from(self, index: int) -> None:
        self.prompt.focus()
        await self.regenerate(index)

    async def regenerate(self, index: int | None = None) -> None:
        if self.services.link.ready_or_say() is None:
            return
        messages = self.session.record.messages
        last = len(messages) - 1
        if index is not None and index != last:
            self.notify("Only the last reply can be regenerated; press b on a message to branch from it.",
                        severity="warning")
            return
        if not messages:
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        await self.abandon()
        await self.start_reply(keep=last if messages[-1].role == "assistant" else last + 1)

    def edit_message(self, index: int) -> None:
        messages = self.session.record.messages
        if index >= len(messages):
            return
        if messages[index].role != "user":
            self.notify("Only your own messages can be edited; regenerate or branch a reply instead.",
                        severity="warning")
            return

        edited = messages[index]

        async def done(text: str | None) -> None:
            # The dialog gives focus back to the message it was opened from: the walk ends here either way.
            self.prompt.focus()
            if text is None or not self.services.is_open(self.chat_id) or self.services.link.ready_or_say() is None:
                return
            current = self.session.record.messages
            if index >= len(current) or current[index] is not edited:   # the chat changed under the dialog
                self.notify("The chat changed while you edited; nothing was resent. Your text was:\n"
                            f"{text}", severity="warning", timeout=15)
                return
            await self.abandon()
            await self.start_reply(keep=index, ask=text)

        self.app.push_screen(EditMessageScreen(edited.content), done)

    async def branch(self, index: int | None = None) -> None:
        """A new tab with the messages up to `index` (the focused or last one); a live reply there is forked."""
        session = self.session
        if index is None:
            focused = self.focused_message
            index = focused.index if focused else len(session.record.messages) - 1
        if index < 0:
            self.notify("Nothing to branch yet: send a message first.", severity="warning")
            return
        if session.busy and index == session.reply.index:
            await self._fork_live()
        else:
            await self._branch_at(index)

    async def _branch_at(self, index: int) -> None:
        """A new tab with the messages up to `index`; ending on a question, it is answered there."""
        messages = deepcopy(self.session.record.messages[:index + 1])
        branch = ChatSession(branch_record(self.session.record, messages), turns=self.session.turns_before(index + 1))
        block_size = self.backend.info.block_size if self.backend is not None else None
        branch.pages, branch.page_tokens = inherited_pages(branch.previous(index + 1), block_size)
        view = await self.services.open_chat(branch, after=self.session)
        view.save(messages=True)
        if messages[-1].role == "user" and self.backend is not None:
            await view.start_reply()

    async def _fork_live(self) -> None:
        """Branch at the reply being written: the backend forks it (locally, sharing its pages copy-on-write)."""
        session, reply = self.session, self.session.reply
        index = reply.index
        try:
            forked = reply.fork(self.backend, session.record.settings, self.services.inbox.callback(""))
        except Exception as exc:
            self.notify(f"Cannot fork this reply ({exc}); branching from the last finished message.",
                        severity="warning")
            await self._branch_at(index - 1)
            return
        messages = deepcopy(session.record.messages[:index]) + [ChatMessage("assistant", reply.content)]
        branch = ChatSession(branch_record(session.record, messages), reply=forked, turns=session.turns_before(index))
        view = await self.services.open_chat(branch, after=session)
        self.services.changed(branch)   # once it has its tab: the status line counts it
        if (message := view.view_at(index)) is not None:
            message.set_stats("forked: continuing this reply…")
        view.save(messages=True)

    def copy_message(self, index: int, code: bool = False) -> None:
        if 0 <= index < len(self.session.record.messages):
            copying.copy_message(self.app, self.session.record.messages[index], code)

    def copy_last(self, code: bool) -> None:
        messages = self.session.record.messages
        last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), None)
        if last is None:
            self.notify("No reply to copy yet.", severity="warning")
        else:
            self.copy_message(last, code=code)

    def rename(self) -> None:
        def done(title: str | None) -> None:
            if title and self.services.is_open(self.chat_id):
                self.session.record.title = title
                self.services.changed(self.session)
                self.save(row=True)

        self.app.push_screen(RenameScreen(self.session.record.title), done)

    def settings(self) -> None:
        record = self.session.record

        def done(result) -> None:
            if result and self.services.is_open(self.chat_id):
                record.system_prompt, record.settings = result
                self.save(row=True)
                self.notify("Settings saved; they apply from the next reply.", timeout=3)

        self.app.push_screen(ChatSettingsScreen(record.title, record.system_prompt, record.settings), done)
