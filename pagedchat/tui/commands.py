"""Palette entries for finding and keeping chats (a `textual.command.Provider`, as in Posting), and the two
palettes they open: earlier prompts (fuzzy) and a full-text search over every saved chat."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from textual.command import CommandPalette, DiscoveryHit, Hit, Hits, Provider
from textual.content import Content

from pagedchat.tui import chat_ops, context
from pagedchat.tui.records import MATCH_CLOSE, MATCH_OPEN, SearchHit
from pagedchat.tui.screens.compare import start_compare


@dataclass(frozen=True)
class Entry:
    title: str
    help: str
    run: Callable


class ChatCommands(Provider):
    """Search chats, prompt history, delete, continue, export/import, compare."""

    def entries(self) -> list[Entry]:
        app = self.app
        return [
            Entry("Search chats…", "Find a word in every saved chat, open or closed, and jump to it",
                  partial(open_palette, app, ChatSearch, "Search all chats…")),
            Entry("Prompt history…", "Pick one of your earlier prompts (fuzzy search) into the input; ↑ also "
                  "walks them", partial(open_palette, app, PromptHistorySearch, "Search earlier prompts…")),
            Entry("Delete chat…", "Delete this chat for good, after asking (F8)",
                  partial(chat_ops.confirm_delete, app)),
            Entry("Continue in a new chat", "The system prompt and the last turns that fit, in a new tab",
                  partial(context.continue_in_new_chat, app)),
            Entry("Import a chat from JSON…", "A JSON export (or OpenAI messages) as a new chat",
                  partial(chat_ops.ask_import, app)),
            Entry("Compare…", "Answer the last prompt twice with different settings, side by side (F5)",
                  partial(start_compare, app)),
        ]

    def closed_entries(self) -> list[Entry]:
        return [Entry(f"Delete chat: {title}", f"Closed chat, {count} messages: delete it for good",
                      partial(chat_ops.confirm_delete, self.app, cid))
                for cid, title, count in self.app.store.closed_chats()]

    async def discover(self) -> Hits:
        for entry in self.entries():
            yield DiscoveryHit(Content(entry.title), entry.run, help=entry.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for entry in self.entries() + self.closed_entries():
            if (score := matcher.match(entry.title)) > 0:
                yield Hit(score, matcher.highlight(entry.title), entry.run, help=entry.help)


def open_palette(app, provider: type[Provider], placeholder: str) -> None:
    app.push_screen(CommandPalette(providers=[provider], placeholder=placeholder))


class PromptHistorySearch(Provider):
    """Earlier prompts, newest first; the picked one goes into the active chat's input."""

    SHOWN = 40

    def _put(self, text: str) -> None:
        session = self.app.active_session
        view = self.app.chat_view(session) if session else None
        if view is not None:
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
