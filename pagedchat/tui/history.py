"""Prompt recall: Up on the input's first line brings back earlier prompts, newest first, across all chats.

One PromptHistory for the app (loaded from the store, added to as prompts are sent); each input walks it with
its own position and keeps what was typed before the walk began, so Down past the newest gives it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

from pagedchat.tui.chat_widgets import PromptInput


@dataclass
class Walk:
    position: int = -1      # -1: the user's own draft; 0: the newest prompt
    draft: str = ""


@dataclass
class PromptHistory:
    prompts: list[str] = field(default_factory=list)    # newest first, no repeats
    _walks: WeakKeyDictionary = field(default_factory=WeakKeyDictionary)

    def add(self, text: str) -> None:
        if text in self.prompts:
            self.prompts.remove(text)
        self.prompts.insert(0, text)

    def step(self, prompt: PromptInput, step: int) -> None:
        """step -1: one prompt older; +1: one newer, then back to the draft."""
        walk = self._walks.setdefault(prompt, Walk())
        if walk.position == -1:
            walk.draft = prompt.text
        position = max(-1, min(len(self.prompts) - 1, walk.position - step))
        if position == walk.position:
            return
        walk.position = position
        prompt.recalling = position >= 0
        text = self.prompts[position] if position >= 0 else walk.draft
        prompt.text = text
        # Older: the cursor on the first line, so Up again goes further back; newer: on the last, for Down.
        prompt.move_cursor((0, 0) if step < 0 else prompt.document.end)

    def forget_walk(self, prompt: PromptInput) -> None:
        """The prompt was sent: the next Up starts again from the newest."""
        self._walks.pop(prompt, None)
        prompt.recalling = False
