"""Small modal dialogs. Each dismisses with its result, or None when cancelled (Esc).

User and model text goes in as plain text, never markup. The editable fields show terminal controls as
pictures (pagedchat.text); a field saved unchanged gives back the original text, controls and all.
"""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, TextArea
from textual.widgets.option_list import Option

from pagedchat.engine.params import CHAT_FIELDS
from pagedchat.text import plain, visible_controls
from pagedchat.tui.conversation import ChatSettings
from pagedchat.tui.saver import Saver, export_chats


def unless_unchanged(edited: str, original: str) -> str:
    """What a field saved: the original text when the field still shows it as it was loaded."""
    return original if edited == visible_controls(original) else edited


class Dialog(ModalScreen):
    """A modal dialog under a heading (plain text); Esc or a Cancel button dismisses it with None. It opens
    with its first field focused (not the scrolling frame around the fields), so typing goes straight in."""

    AUTO_FOCUS = "TextArea, Input, OptionList, Button"

    def __init__(self, heading: str = "") -> None:
        super().__init__()
        self.heading = heading

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="modal.cancel")]

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#cancel")
    def _cancel_pressed(self) -> None:
        self.dismiss(None)


class EditMessageScreen(Dialog):
    """Edit a sent message; saving truncates the chat there and sends the new text."""

    BINDINGS = [Binding("ctrl+s", "save", "Resend", id="modal.save")]

    def __init__(self, text: str) -> None:
        super().__init__()
        self._text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog -wide"):
            yield Label("Edit message — later messages are replaced by a new reply", classes="dialog-title")
            yield TextArea(visible_controls(self._text), id="text", soft_wrap=True, tab_behavior="focus")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Resend", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
            yield Label("ctrl+s resends · Esc cancels", classes="dialog-hint")

    def action_save(self) -> None:
        text = unless_unchanged(self.query_one("#text", TextArea).text, self._text)
        self.dismiss(text if text.strip() else None)

    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()


class ChatSettingsScreen(Dialog):
    """A chat's system prompt and sampling settings. Dismisses with (system_prompt, ChatSettings)."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", id="modal.save")]

    def __init__(self, title: str, system_prompt: str, settings: ChatSettings) -> None:
        super().__init__(f"Settings — {title}")
        self._system = system_prompt
        self._settings = settings

    def compose(self) -> ComposeResult:
        s = self._settings
        with VerticalScroll(classes="dialog -wide"):
            yield Label(plain(self.heading), classes="dialog-title")
            yield Label("System prompt")
            yield TextArea(visible_controls(self._system), id="system", soft_wrap=True, tab_behavior="focus")
            with Grid(classes="settings-grid"):
                for f in CHAT_FIELDS:
                    value = getattr(s, f.name)
                    yield Label(f.help)
                    yield Input("" if value is None else str(value), id=f.name,
                                type="integer" if f.kind is int else "number", compact=True)
            yield Label("", id="error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
            yield Label("ctrl+s saves · Esc cancels", classes="dialog-hint")

    def _read(self) -> ChatSettings:
        """The settings typed; ValueError names the first field that is wrong, as a request would."""
        return ChatSettings(**{f.name: f.parse(self.query_one(f"#{f.name}", Input).value) for f in CHAT_FIELDS})

    def action_save(self) -> None:
        try:
            settings = self._read()
        except ValueError as exc:
            self.query_one("#error", Label).update(plain(str(exc)))
            return
        self.dismiss((unless_unchanged(self.query_one("#system", TextArea).text, self._system), settings))

    @on(Input.Submitted)
    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        self.action_save()


class PickScreen(Dialog):
    """Choose one of several options (a message to branch at, a code block to copy, a chat to reopen). It opens
    on option `highlighted`, by default the last: the newest message, or the last code block."""

    def __init__(self, title: str, options: list[tuple[str, object]], highlighted: int = -1) -> None:
        super().__init__(title)
        self._values = [value for _, value in options]
        self._labels = [label for label, _ in options]
        self._highlighted = highlighted

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide"):
            yield Label(plain(self.heading), classes="dialog-title")
            yield OptionList(*[Option(plain(label), id=str(i)) for i, label in enumerate(self._labels)],
                             id="options")
            yield Label("Enter picks · Esc cancels", classes="dialog-hint")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        if self._labels:
            options.highlighted = range(len(self._labels))[self._highlighted]

    @on(OptionList.OptionSelected)
    def pick(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self._values[int(event.option.id)])


class UnsavedQuitScreen(Dialog):
    """Quitting while chats cannot be saved (a full disk). Dismisses with None (Esc, "Keep trying": back to the
    chats), "exported" once they are written to the folder typed (`exported` lists the files), "quit" (quit
    anyway, losing them), or "saved": the app's retries wrote them while the dialog was up."""

    POLL_S = 0.5

    def __init__(self, saver: Saver, folder: Path) -> None:
        unsaved = len(saver.unsaved_chats())
        super().__init__(f"{unsaved} chat{'s' if unsaved > 1 else ''} could not be saved ({saver.failing}). "
                         "pagedchat keeps retrying and quits by itself once they are saved.")
        self._saver = saver
        self._folder = folder
        self.exported: list[Path] = []

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog -wide"):
            yield Label(plain(self.heading), classes="dialog-title -question")
            yield Label("Export them as JSON (`pagedchat import` reads it) into this folder:")
            yield Input(str(self._folder), id="folder")
            yield Label("", id="error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Export and quit", variant="primary", id="export")
                yield Button("Keep trying", id="cancel")
                yield Button("Quit, losing them", variant="error", id="quit")
            yield Label("Enter exports · Esc keeps trying", classes="dialog-hint")

    def on_mount(self) -> None:
        self.set_interval(self.POLL_S, self._check_saved)

    def _check_saved(self) -> None:
        if not self._saver.unsaved_chats():
            self.dismiss("saved")

    @on(Input.Submitted)
    @on(Button.Pressed, "#export")
    def _export_pressed(self) -> None:
        typed = self.query_one("#folder", Input).value.strip()
        if not typed:
            self.query_one("#error", Label).update("Type the folder to export into.")
            return
        folder = Path(typed).expanduser()
        try:
            self.exported = export_chats(self._saver.unsaved_chats(), folder)
        except OSError as exc:
            self.query_one("#error", Label).update(plain(f"Cannot write to {folder}: {exc.strerror or exc}"))
            return
        self.dismiss("exported")

    @on(Button.Pressed, "#quit")
    def _quit_pressed(self) -> None:
        self.dismiss("quit")
