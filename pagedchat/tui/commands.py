"""The command palette: every pagedchat command in one list (a `textual.command.Provider`, as in Posting),
and the two palettes it opens: earlier prompts (fuzzy) and a full-text search over every saved chat."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from textual.command import CommandPalette, DiscoveryHit, Hit, Hits, Provider
from textual.content import Content

from pagedchat.text import escaped_markup
from pagedchat.tui import chat_ops, context
from pagedchat.tui.conversation import MATCH_CLOSE, MATCH_OPEN, SearchHit


@dataclass(frozen=True)
class Entry:
    title: str                 # plain text, never markup
    help: str                  # markup: user text in it goes through escaped_markup
    run: Callable
    discover: bool = True      # listed before anything is typed; else found by searching only


class AppCommands(Provider):
    """Every pagedchat command, for the chats' own screen (not over a dialog): chats and tabs, the reply,
    finding and keeping chats, the engine. Textual's own (theme, quit, keys, screenshot) come alongside."""

    def commands(self) -> list[Entry]:
        app = self.app
        if self.screen is not app.screen_stack[0]:
            return []
        entries = [
            Entry("New chat", "Open a chat in a new tab (ctrl+n)", app.action_new_chat),
            Entry("Close chat", "Close this tab; it stays saved and can be reopened (ctrl+w)", app.action_close_chat),
            Entry("Next chat", "Switch to the next tab (ctrl+pagedown)", app.action_next_chat),
            Entry("Previous chat", "Switch to the previous tab (ctrl+pageup)", app.action_prev_chat),
            Entry("Rename chat", "Give this chat a new title (F4)", app.action_rename_chat),
            Entry("Chat settings", "System prompt and sampling for this chat (F3)", app.action_chat_settings),
            Entry("Memory inspector", "Show or hide the KV-cache page inspector (F2)", app.action_toggle_inspector),
            Entry("Help", "Keys, the inspector, where files are kept (F1)", app.action_help),
            Entry("Regenerate last reply", "Replace the last reply with a new one (ctrl+r)", app.action_regenerate),
            Entry("Branch at the last message", "Branch here; a live reply is forked (ctrl+b)", app.action_branch),
            Entry("Export chat…", "Markdown, or JSON that imports back, in "
                  f"{escaped_markup(str(app.config.data_dir / 'exports'))} (ctrl+o)", app.action_export_chat),
            Entry("Search chats…", "Find a word in every saved chat, open or closed, and jump to it",
                  partial(open_palette, app, ChatSearch, "Search all chats…")),
            Entry("Prompt history…", "Pick one of your earlier prompts (fuzzy search) into the input; ↑ also "
                  "walks them", partial(open_palette, app, PromptHistorySearch, "Search earlier prompts…")),
            Entry("Delete chat…", "Delete this chat for good, after asking (F8)", app.action_delete_chat),
            Entry("Continue in a new chat", "The system prompt and the last turns that fit, in a new tab",
                  partial(context.continue_in_new_chat, app)),
            Entry("Import a chat from JSON…", "A JSON export (or OpenAI messages) as a new chat",
                  partial(chat_ops.ask_import, app)),
            Entry("Compare…", "Answer the last prompt twice with different settings, side by side (F5)",
                  app.action_compare),
        ]
        if (chat := app.active_chat) is not None:
            entries += [
                Entry("Stop reply", "Stop the reply in this tab (Esc)", chat.stop),
                Entry("Branch chat at a message…", "Copy the chat up to a message into a new tab",
                      partial(chat_ops.pick_message, app, "Branch at which message?", chat.branch)),
                Entry("Edit a message and resend…", "Change one of your messages and reply again",
                      partial(chat_ops.pick_message, app, "Edit which message?", chat.edit_message, "user")),
                Entry("Copy last reply", "To the clipboard (OSC 52)", partial(chat.copy_last, False)),
                Entry("Copy a code block from the last reply", "To the clipboard (OSC 52)",
                      partial(chat.copy_last, True)),
            ]
        if app.link.failure is not None:
            entries.append(Entry("Restart engine", f"The engine stopped ({escaped_markup(app.link.failure)}); "
                                 "load it again", app.link.restart))
        for cid, title, count in app.store.closed_chats():
            entries.append(Entry(f"Reopen chat: {title}", f"Closed chat, {count} messages",
                                 partial(app.reopen_chat, cid), discover=False))
            entries.append(Entry(f"Delete chat: {title}", f"Closed chat, {count} messages: delete it for good",
                                 partial(chat_ops.confirm_delete, app, cid), discover=False))
        return entries

    async def discover(self) -> Hits:
        for entry in sorted(self.commands(), key=lambda e: e.title):   # as Textual lists its own commands
            if entry.discover:
                yield DiscoveryHit(Content(entry.title), entry.run, help=entry.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for entry in self.commands():
            if (score := matcher.match(entry.title)) > 0:
                yield Hit(score, matcher.highlight(escaped_markup(entry.title)), entry.run, help=entry.help)


def open_palette(app, provider: type[Provider], placeholder: str) -> None:
    app.push_screen(CommandPalette(providers=[provider], placeholder=placeholder))


class PromptHistorySearch(Provider):
    """Earlier prompts, newest first; the picked one goes into the active chat's input."""

    SHOWN = 40

    def _put(self, text: str) -> None:
        if (view := self.app.active_chat) is not None:
            view.prompt.text = text
            view.prompt.move_cursor(view.prompt.document.end)
            view.prompt.focus()

    @staticmethod
    def _line(text: str) -> str:
        return " ".join(text.split())

    async def discover(self) -> Hits:
        for text in self.app.prompt_history.prompts[:self.SHOWN]:
            # Content, not a str: a prompt is text, never markup.
            yield DiscoveryHit(Content(self._line(text)[:100]), partial(self._put, text), text=text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text in self.app.prompt_history.prompts:
            line = self._line(text)
            if (score := matcher.match(line)) > 0:
                yield Hit(score, matcher.highlight(line[:100]), partial(self._put, text), text=text)


def snippet_content(hit: SearchHit) -> Content:
    """"Title · You: …the matched words…", the matched words in bold."""
    parts: list = [(hit.title, "bold"), (" · You: " if hit.role == "user" else " · Assistant: ", "$text-muted")]
    for n, piece in enumerate(hit.snippet.replace(MATCH_CLOSE, MATCH_OPEN).split(MATCH_OPEN)):
        parts.append((piece, "bold $text-accent") if n % 2 else piece)
    if not hit.is_open:
        parts.append(("  (closed)", "$text-muted"))
    return Content.assemble(*parts)


class ChatSearch(Provider):
    """Full-text search (FTS5) over every message of every saved chat; Enter opens the chat at the message."""

    async def search(self, query: str) -> Hits:
        hits = self.app.store.search(query)
        for rank, hit in enumerate(hits):
            yield Hit(1.0 - rank / (len(hits) + 1), snippet_content(hit),
                      partial(chat_ops.open_at, self.app, hit.chat_id, hit.message_index), text=hit.title)
