"""Copying a message, or a code block of it, to the clipboard (OSC 52: it works over ssh too)."""

from __future__ import annotations

from textual.app import App

from pagedchat.tui.conversation import ChatMessage
from pagedchat.tui.screens.modals import PickScreen


def copy_text(app: App, text: str, what: str) -> None:
    app.copy_to_clipboard(text)
    app.notify(f"Copied the {what} ({len(text)} characters) to the clipboard via OSC 52.", timeout=3)


def copy_message(app: App, message: ChatMessage, code: bool = False) -> None:
    """The whole message, or (code) its one code block, or the one the user picks of several."""
    if not code:
        copy_text(app, message.content, "message")
        return
    blocks = message.code_blocks()
    if not blocks:
        app.notify("This message has no code block.", severity="warning")
    elif len(blocks) == 1:
        copy_text(app, blocks[0], "code block")
    else:
        options = [(b.strip().splitlines()[0][:60] if b.strip() else "(empty)", b) for b in blocks]
        app.push_screen(PickScreen("Copy which code block?", options),
                        lambda b: b is not None and copy_text(app, b, "code block"))
