"""How full a chat's context is: the figure on its input's border, the check before sending, and carrying a
full chat over into a new one.

A chat's size is what its last request held (prompt plus generated tokens): the backend's own count, so it
needs no re-tokenising. While a reply streams it grows with each update. The app never tokenizes, and never
waits on the engine to count a message before sending it: the backend refuses one that cannot fit, and the chat
is put back as it was (chat_view.py).
"""

from __future__ import annotations

import threading
from copy import deepcopy
from dataclasses import dataclass

from textual.content import Content

from pagedchat.errors import PagedChatError, RequestError

from pagedchat.tui.conversation import ChatMessage, ChatRecord
from pagedchat.tui.session import ChatSession

WARN_AT = 0.70      # the theme's warning colour from here
ERROR_AT = 0.90     # and its error colour from here
CARRY_SHARE = 0.5   # a continued chat starts with at most this share of the context, leaving room to talk

CONTINUE_HINT = "ctrl+p → “Continue in a new chat” carries the system prompt and the last turns over"


@dataclass(frozen=True)
class ContextFill:
    used: int
    limit: int

    @property
    def fraction(self) -> float:
        return self.used / self.limit if self.limit else 0.0

    def style(self) -> str:
        if self.fraction >= ERROR_AT:
            return "$error"
        if self.fraction >= WARN_AT:
            return "$warning"
        return ""   # the border's own subtitle colour (pagedchat.tcss)

    def content(self) -> Content:
        return Content.styled(f" {self.used:,} / {self.limit:,} ", self.style())


# A rough English-text rule, only where the backend cannot count (a remote server): a carried chat then fits
# the budget approximately, and the server's own refusal still guards the limit.
CHARS_PER_TOKEN = 4


def context_length(backend) -> int | None:
    """The model's context in tokens (the backend refuses prompts that reach it); None without a backend or
    from one that does not say (a stand-in, a server that does not report it): then no figure is shown and
    nothing is checked before sending, and the backend's own refusal is what the user sees."""
    return backend.info.context_length if backend is not None else None


def tokens_in_use(session: ChatSession) -> int:
    """Tokens the chat holds: the live request's so far, else what its last reply's request held."""
    if session.busy:
        return session.reply.tokens_held()
    for message in reversed(session.record.messages):
        if message.role == "assistant" and message.stats is not None:
            if not message.stats.counted:   # a server that reports no usage: an estimate from the text
                return sum(len(m["content"]) for m in session.record.conversation()) // CHARS_PER_TOKEN
            return message.stats.prompt_tokens + message.stats.generated_tokens
    return 0


def fill(session: ChatSession, backend) -> Content | None:
    """The chat's figure for its input's bottom border (None until the backend is there)."""
    limit = context_length(backend)
    return ContextFill(tokens_in_use(session), limit).content() if limit is not None else None


def refused_notice(error: Exception, back_in_input: bool) -> str:
    """What the app says when the backend refuses a reply after taking it (the engine process answers a start
    later). A RequestError is a prompt that can never run: too long for the context or for the cache."""
    back = " Your message is back in the input." if back_in_input else ""
    hint = f" {CONTINUE_HINT}." if isinstance(error, RequestError) else ""
    return f"Cannot send: {str(error).rstrip('.')}.{back}{hint}"


CONTEXT_FULL = f"Context full: the reply stopped at the model's limit. {CONTINUE_HINT}."


def conversation_tokens(backend, conversation: list[dict]) -> int:
    """The backend's count where it can count, else an estimate from the characters (CHARS_PER_TOKEN)."""
    count = backend.prompt_tokens(conversation)
    if count is not None:
        return count
    return sum(len(m["content"]) for m in conversation) // CHARS_PER_TOKEN


def carried_messages(record: ChatRecord, count_tokens, budget: float) -> list[ChatMessage]:
    """The longest run of whole last turns (each from a user message on) whose prompt fits `budget`."""
    starts = [i for i, m in enumerate(record.messages) if m.role == "user"]
    keep: list[ChatMessage] = []
    for start in reversed(starts):
        candidate = record.messages[start:]
        trial = ChatRecord(system_prompt=record.system_prompt, messages=candidate)
        if count_tokens(trial.conversation()) > budget:
            break
        keep = candidate
    return [ChatMessage(m.role, m.content, m.stats) for m in keep]


def continue_in_new_chat(app) -> threading.Thread | None:
    """A new tab with the active chat's system prompt, settings and the last turns that fit half the context.
    Counting them asks the backend, which may be slow to answer: that runs on a thread (returned), and the tab
    opens on the app's loop once it is done."""
    session = app.active_session
    if session is None or (backend := app.link.ready_or_say()) is None:
        return None
    record = session.record   # a copy to count from: the chat may change meanwhile
    source = ChatRecord(title=record.title, system_prompt=record.system_prompt, settings=deepcopy(record.settings),
                        messages=list(record.messages))
    limit = context_length(backend)
    budget = int(limit * CARRY_SHARE) if limit is not None else float("inf")   # unknown: carry every turn

    def count() -> None:
        try:
            messages = carried_messages(source, lambda conv: conversation_tokens(backend, conv), budget)
        except PagedChatError as exc:
            app.call_later(app.notify, f"Cannot continue in a new chat: {exc}", severity="error", timeout=10)
            return
        app.call_later(_open_continued, app, session, source, messages)

    thread = threading.Thread(target=count, name="pagedchat-carry", daemon=True)
    thread.start()
    return thread


async def _open_continued(app, session: ChatSession, source: ChatRecord, messages: list[ChatMessage]) -> None:
    new = ChatSession(ChatRecord(title=f"↪ {source.title}"[:40], system_prompt=source.system_prompt,
                                 settings=source.settings, messages=messages))
    after = session if app.chats.is_open(session.id) else None
    (await app.chats.open(new, after=after)).save(messages=True)
    dropped = len(source.messages) - len(messages)
    app.notify(f"Continued in a new chat with the last {len(messages)} messages ({dropped} left behind).",
               timeout=6)
