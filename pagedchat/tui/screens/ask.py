"""Small questions: yes or no before something cannot be undone, and a line of text (a file path, a title)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label

from pagedchat.text import plain, visible_controls
from pagedchat.tui.screens.modals import Dialog, unless_unchanged


class ConfirmScreen(Dialog):
    """Dismisses with True only when the user confirms (the button, or y); Esc and n say no."""

    BINDINGS = [Binding("y", "confirm", "Yes", id="confirm.yes"), Binding("n", "cancel", "No", id="confirm.no")]

    def __init__(self, question: str, action: str) -> None:
        super().__init__()
        self._question = question
        self._action = action

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(plain(self._question), classes="dialog-title -question")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self._action, variant="error", id="confirm", action="screen.confirm")
                yield Button("Cancel", id="cancel")
            yield Label("y confirms · n or Esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()   # Enter on the default does the harmless thing

    def action_confirm(self) -> None:
        self.dismiss(True)


class AskTextScreen(Dialog):
    """One line of text; dismisses with it stripped, or None."""

    DIALOG = "dialog -wide"
    FIELD = "text"

    def __init__(self, title: str, value: str, hint: str) -> None:
        super().__init__(title)
        self._value = value
        self._hint = hint

    def compose(self) -> ComposeResult:
        with Vertical(classes=self.DIALOG):
            yield Label(plain(self.heading), classes="dialog-title")
            yield Input(self._value, id=self.FIELD)
            yield Label(self._hint, classes="dialog-hint")

    def answer(self, value: str) -> str | None:
        return value.strip() or None

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(self.answer(event.value))


class RenameScreen(AskTextScreen):
    """A chat's new title, or None."""

    DIALOG = "dialog"
    FIELD = "title"

    def __init__(self, title: str) -> None:
        super().__init__("Rename chat", visible_controls(title), "Enter saves · Esc cancels")
        self._original = title

    def answer(self, value: str) -> str | None:
        return unless_unchanged(value, self._original).strip() or None
