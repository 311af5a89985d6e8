"""What the palette and keys do to whole chats: open one at a message, pick one of its messages, delete one
for good, export, import.

Each takes the app and goes through its tabs (`app.chats`, tabs.py), so a chat reached from here behaves like
one opened with ctrl+n.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from textual.widgets import TabbedContent

from pagedchat.tui.conversation import ChatRecord, title_from
from pagedchat.tui.screens.ask import AskTextScreen, ConfirmScreen
from pagedchat.tui.screens.modals import PickScreen
from pagedchat.tui.session import ChatSession
from pagedchat.tui.transfer import (ExportFormat, NotAChatExport, export_path, imported_title, read_chat_file,
                                    render)


async def open_at(app, chat_id: str, index: int) -> None:
    """Show a chat (reopening it if closed) with message `index` focused and at the top of the view."""
    # Shown and activated here, once: the TabActivated that showing it posts would activate it a second time,
    # later, and send the focus from the message back to the input.
    with app.chats.tabbed.prevent(TabbedContent.TabActivated):
        session = await _shown(app, chat_id)
    if session is None or (view := app.chat_view(session)) is None:
        return
    await view.populate()
    if (message := await view.log_view.reveal(index)) is not None:   # an old message is mounted, with a page around it
        jump_when_laid_out(message)


async def _shown(app, chat_id: str) -> ChatSession | None:
    if (session := app.sessions.get(chat_id)) is not None:
        app.chats.show(session)
        await app.chats.activated(session)
        return session
    await app.reopen_chat(chat_id)
    if (session := app.sessions.get(chat_id)) is None:
        app.notify("That chat is no longer saved.", severity="warning")
    return session


def jump_when_laid_out(message) -> None:
    """Focus a message and scroll it to the top of its chat once a layout has placed it. Not "after the next
    refresh": the palette that asked holds screen updates back as it closes (delay_update), and callbacks
    after a refresh then run at once, before a tab just shown is laid out, so the jump found no place to
    scroll to and the chat stayed where it was (at its bottom, where it was anchored)."""
    signal = message.screen.screen_layout_refresh_signal

    def laid_out(_screen) -> None:
        if message.virtual_region:
            signal.unsubscribe(message)
            message.focus(scroll_visible=False)
            message.scroll_visible(animate=False, top=True, immediate=True)

    signal.unsubscribe(message)      # a newer jump to the same message replaces the older one
    signal.subscribe(message, laid_out)
    message.refresh(layout=True)     # so that a layout comes even where nothing else changed


def pick_message(app, title: str, then: Callable[[int], object], role: str | None = None) -> None:
    """Ask which message of the active chat (only `role`'s, if given), then call then(index)."""
    session = app.active_session
    if session is None or not session.record.messages:
        app.notify("This chat has no messages yet.", severity="warning")
        return
    options = [(f"{i + 1}. {'You' if m.role == 'user' else 'Assistant'}: {title_from(m.content, 50)}", i)
               for i, m in enumerate(session.record.messages) if role is None or m.role == role]
    if not options:
        app.notify("No message to pick.", severity="warning")
        return
    app.push_screen(PickScreen(title, options), lambda i: i is not None and then(i))


def confirm_delete(app, chat_id: str | None = None) -> None:
    """Ask, then delete the chat (the active one by default) from the tabs, the database and the index."""
    if chat_id is None:
        if app.active_session is None:
            return
        chat_id = app.active_session.id
    session = app.sessions.get(chat_id)
    record = session.record if session else app.store.load_chat(chat_id)
    if record is None:
        return
    title = record.title

    async def answered(yes: bool | None) -> None:
        if yes:
            await delete_chat(app, chat_id, title)

    app.push_screen(ConfirmScreen(f"Delete “{title}” for good? It cannot be brought back.", "Delete"), answered)


async def delete_chat(app, chat_id: str, title: str) -> None:
    session = app.sessions.get(chat_id)
    if session is not None:
        await app.chats.remove(session)
    app.saver.delete_chat(chat_id)   # a failed write is retried, and nothing unsaved brings the chat back
    app.saver.flush()
    app.prompt_history.prompts = app.store.recent_prompts()   # its prompts go too
    app.notify(f"Deleted “{title}”.", timeout=4)


def export_chat(app, session: ChatSession, fmt: ExportFormat) -> Path | None:
    folder = app.config.data_dir / "exports"
    path = export_path(folder, session.record, fmt)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(render(session.record, fmt), encoding="utf-8")
    except OSError as exc:
        app.notify(f"Export failed: {exc}", severity="error")
        return None
    app.notify(f"Exported to {path}", timeout=8)
    return path


def offer_export(app) -> None:
    session = app.active_session
    if session is None:
        return
    # Markdown first, and the one Enter picks: it is what ctrl+o always wrote.
    options = [("Markdown: to read or share (.md)", ExportFormat.MARKDOWN),
               ("JSON: messages and settings, imports back (.json)", ExportFormat.JSON)]
    app.push_screen(PickScreen("Export this chat as", options, highlighted=0),
                    lambda fmt: fmt is not None and export_chat(app, session, fmt))


async def import_chat(app, path: Path) -> ChatSession | None:
    try:
        record = read_chat_file(path)
    except NotAChatExport as exc:
        app.notify(f"Not imported: {exc}", severity="error", timeout=10)
        return None
    # Open chats too: a title changed in a tab may not be saved yet.
    taken = {r.title for r in app.store.load_chats()} | {s.record.title for s in app.sessions.values()}
    record.title = imported_title(record.title, taken)
    session = ChatSession(record)
    (await app.chats.open(session, after=app.active_session)).save(messages=True)
    app.notify(f"Imported “{record.title}” ({len(record.messages)} messages).", timeout=5)
    return session


def ask_import(app) -> None:
    async def chosen(text: str | None) -> None:
        if text:
            await import_chat(app, Path(text).expanduser())

    start = f"{app.config.data_dir / 'exports'}/"
    app.push_screen(AskTextScreen("Import a chat from a JSON file", start,
                                  "Enter imports it as a new chat · Esc cancels"), chosen)


def save_imported(store, record: ChatRecord) -> None:
    """The CLI's import: a new open chat after the open tabs, shown at the next start."""
    saved = store.load_chats()
    record.title = imported_title(record.title, {r.title for r in saved})
    record.position = sum(r.is_open for r in saved)
    store.save_chat(record)
