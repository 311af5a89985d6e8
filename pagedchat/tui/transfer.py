"""Export a chat as Markdown (to read) or JSON (to bring back), and import such JSON as a new chat.

The JSON is the OpenAI `messages` shape with the rest of a chat beside it:
`{"title", "system", "messages": [{"role", "content"}], "settings"}`. A file that is not one is refused with
one line saying what is wrong, and nothing is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from dataclasses import fields
from itertools import count
from enum import Enum
from pathlib import Path

from pagedchat.text import visible_controls
from pagedchat.tui.conversation import ChatMessage, ChatRecord, ChatSettings, slug, title_from


class ExportFormat(Enum):
    MARKDOWN = "md"
    JSON = "json"


class NotAChatExport(ValueError):
    """The file is not a chat export; the message says why in one line."""


# JSON escapes C0 controls itself; DEL and C1 too, so the file is safe to `cat` and the text comes back exact.
_JSON_CONTROL_ESCAPES = {code: f"\\u{code:04x}" for code in range(0x7F, 0xA0)}


def to_json(record: ChatRecord) -> str:
    return json.dumps({"title": record.title, "system": record.system_prompt,
                       "messages": [{"role": m.role, "content": m.content} for m in record.messages],
                       "settings": record.settings.to_dict()},
                      ensure_ascii=False, indent=2).translate(_JSON_CONTROL_ESCAPES) + "\n"


def render(record: ChatRecord, fmt: ExportFormat) -> str:
    # Shown with `cat` or a pager, Markdown is a terminal path too: its controls become pictures.
    return to_json(record) if fmt is ExportFormat.JSON else visible_controls(record.to_markdown())


def export_path(folder: Path, record: ChatRecord, fmt: ExportFormat) -> Path:
    return folder / f"{slug(record.title)}-{time.strftime('%Y%m%d-%H%M%S')}.{fmt.value}"


def _settings(raw) -> ChatSettings:
    if raw is None:
        return ChatSettings()
    if not isinstance(raw, dict):
        raise NotAChatExport("\"settings\" must be an object")
    settings = ChatSettings.from_dict(raw)
    for f in fields(ChatSettings):
        value = getattr(settings, f.name)
        if f.name == "seed" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise NotAChatExport(f"settings.{f.name} must be a number, not {value!r}")
    return settings


def _messages(raw) -> tuple[list[ChatMessage], str | None]:
    """The messages, and a leading system message's text (the OpenAI shape keeps the system prompt there)."""
    if not isinstance(raw, list):
        raise NotAChatExport("\"messages\" must be a list of {\"role\", \"content\"}")
    out, system = [], None
    for n, item in enumerate(raw, start=1):
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise NotAChatExport(f"message {n} needs a text \"content\"")
        role = item.get("role")
        if role == "system" and n == 1:
            system = item["content"]
        elif role in ("user", "assistant"):
            out.append(ChatMessage(role, item["content"]))
        else:
            raise NotAChatExport(f"message {n} has role {role!r}; expected user or assistant")
    return out, system


def from_json(text: str) -> ChatRecord:
    """A new chat (fresh id) from exported JSON; NotAChatExport with one line when it is not one."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotAChatExport(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, list):   # a bare OpenAI `messages` array
        data = {"messages": data}
    if not isinstance(data, dict):
        raise NotAChatExport("expected a JSON object with \"messages\", or a list of messages")
    messages, leading_system = _messages(data.get("messages"))
    system = data.get("system", leading_system or "")
    title = data.get("title") or (title_from(messages[0].content) if messages else "Imported chat")
    if not isinstance(system, str) or not isinstance(title, str):
        raise NotAChatExport("\"title\" and \"system\" must be text")
    return ChatRecord(title=title, system_prompt=system, settings=_settings(data.get("settings")),
                      messages=messages)


def imported_title(title: str, taken: Collection[str]) -> str:
    """The title an imported chat gets: its own, or where a saved chat has that already, "title (imported)",
    then "(imported 2)"..., so that the two can be told apart (in the tabs, in the delete prompt)."""
    if title not in taken:
        return title
    for n in count(1):
        candidate = f"{title} (imported)" if n == 1 else f"{title} (imported {n})"
        if candidate not in taken:
            return candidate


def read_chat_file(path: Path) -> ChatRecord:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NotAChatExport(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return from_json(text)
    except NotAChatExport as exc:
        raise NotAChatExport(f"{path.name}: {exc}") from None
