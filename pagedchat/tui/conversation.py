"""What a chat is, independent of widgets and of the engine: what the store saves and the tabs show."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace

from pagedchat.engine.params import SamplingSettings
from pagedchat.engine.records import FinishReason, Outcome

FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
FENCE_LINE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def close_fences(text: str) -> str:
    """text with a code fence left open at its end (a reply stopped mid-block) closed, as a Markdown reader
    closes it: else everything after it in an export reads as code, and the block is not found to copy."""
    opened: str | None = None
    for line in text.splitlines():
        found = FENCE_LINE.match(line)
        if found is None:
            continue
        marker, rest = found.groups()
        if opened is None:
            opened = marker
        elif marker[0] == opened[0] and len(marker) >= len(opened) and not rest.strip():
            opened = None
    if opened is None:
        return text
    return text + ("" if text.endswith("\n") else "\n") + opened


class ChatSettings(SamplingSettings):
    """Sampling settings of one chat (the type config.toml's defaults have), with their saved form."""

    @classmethod
    def from_defaults(cls, d: SamplingSettings) -> ChatSettings:
        return cls(**asdict(d))

    @classmethod
    def from_dict(cls, raw: dict) -> ChatSettings:
        """Saved settings; a value today's rules refuse (saved by an older version) falls back to its default."""
        settings = cls()
        for f in fields(cls):
            if f.name in raw:
                try:
                    settings = replace(settings, **{f.name: raw[f.name]})
                except ValueError:
                    pass
        return settings

    def to_dict(self) -> dict:
        return asdict(self)


# chats.db keeps a reply's figures (an Outcome's) in its stats column, under the names it has always used.
SAVED_STATS = {"prompt_tokens": "prompt_tokens", "cached_tokens": "cached_tokens",
               "generated_tokens": "generated_tokens", "ttft": "time_to_first_token",
               "tokens_per_s": "decode_tokens_per_s", "finish_reason": "finish_reason", "error": "error",
               "counted": "counted", "drafted": "drafted_tokens", "accepted": "accepted_tokens"}


def reply_stats(outcome: Outcome) -> Outcome:
    """What a message keeps of its reply's Outcome: the figures its stats line shows and chats.db saves."""
    return Outcome(**{name: getattr(outcome, name) for name in SAVED_STATS.values()})


def stats_to_dict(stats: Outcome) -> dict:
    """A reply without drafts (speculative decoding's) saves what replies always saved."""
    return {saved: getattr(stats, name) for saved, name in SAVED_STATS.items()
            if saved not in ("drafted", "accepted") or stats.drafted_tokens}


def stats_from_dict(raw: dict | None) -> Outcome | None:
    if not raw:
        return None
    stats = Outcome(**{SAVED_STATS[k]: v for k, v in raw.items() if k in SAVED_STATS})
    return replace(stats, finish_reason=FinishReason.read(stats.finish_reason))


def stats_line(stats: Outcome) -> str:
    """The quiet line under a reply."""
    if stats.counted:
        parts = [f"prompt {stats.prompt_tokens}", f"cached {stats.cached_tokens}",
                 f"generated {stats.generated_tokens}"]
    else:   # the streamed pieces, which servers send one per token, are the only figure left
        parts = ["tokens not reported", f"{stats.generated_tokens} pieces streamed"]
    ttft = stats.time_to_first_token
    if ttft is not None:
        parts.append(f"TTFT {ttft * 1000:.0f} ms" if ttft < 1 else f"TTFT {ttft:.2f} s")
    if stats.decode_tokens_per_s is not None:
        parts.append(f"{stats.decode_tokens_per_s:.1f} tok/s")
    if stats.drafted_tokens:  # speculative decoding (docs/speculative.md)
        parts.append(f"drafts {stats.accepted_tokens}/{stats.drafted_tokens} kept")
    stopped = "stopped" if stats.generated_tokens else "stopped before the first token"
    ending = {FinishReason.LENGTH: "hit max tokens", FinishReason.CONTEXT_FULL: "context full",
              FinishReason.CANCELLED: stopped, FinishReason.ERROR: f"error: {stats.error}",
              FinishReason.INTERRUPTED: "interrupted"}
    if stats.finish_reason in ending:
        parts.append(ending[stats.finish_reason])
    return " · ".join(parts)


def new_message_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class ChatMessage:
    """id is stable for the message's life: saves upsert by it, so two instances never overwrite each other."""

    role: str                      # "user" or "assistant"
    content: str
    stats: Outcome | None = None   # its reply's figures (reply_stats), for an assistant message
    id: str = field(default_factory=new_message_id)

    def code_blocks(self) -> list[str]:
        return [m.group(2).rstrip("\n") for m in FENCE.finditer(close_fences(self.content))]


def new_chat_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class ChatRecord:
    """A saved chat. position orders the open tabs; closed chats stay in the store and can be reopened."""

    id: str = field(default_factory=new_chat_id)
    title: str = "New chat"
    system_prompt: str = ""
    settings: ChatSettings = field(default_factory=ChatSettings)
    messages: list[ChatMessage] = field(default_factory=list)
    position: int = 0
    is_open: bool = True
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def conversation(self, upto: int | None = None) -> list[dict]:
        """The messages (up to index `upto`, exclusive) in chat-template form, system prompt first."""
        msgs = self.messages if upto is None else self.messages[:upto]
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        return head + [{"role": m.role, "content": m.content} for m in msgs]

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        if self.system_prompt.strip():
            lines += ["> **System:** " + self.system_prompt.strip().replace("\n", "\n> "), ""]
        for m in self.messages:
            lines += [f"## {'You' if m.role == 'user' else 'Assistant'}", "", close_fences(m.content.rstrip()), ""]
            if m.stats is not None:
                lines += [f"*{stats_line(m.stats)}*", ""]
        return "\n".join(lines)


# Around the matched words in a search snippet: plain characters, for the UI to style or show as they are.
MATCH_OPEN, MATCH_CLOSE = "«", "»"


@dataclass(frozen=True)
class SearchHit:
    """A message that matches a search: its chat, its place in the chat's messages, and the words around it."""

    chat_id: str
    title: str
    message_index: int
    role: str
    snippet: str
    is_open: bool


def title_from(text: str, limit: int = 24) -> str:
    """A tab title from the first message: its first line, shortened at a word boundary."""
    line = " ".join(text.strip().split())
    if len(line) <= limit:
        return line or "New chat"
    head = line[:limit + 1]  # +1: a word that ends exactly at the limit stays whole
    cut = head.rsplit(" ", 1)[0] if " " in head else line[:limit]
    return cut.rstrip(",.;:") + "…"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:40] or "chat"
