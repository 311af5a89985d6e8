"""Every key names a method of the widget, screen or app that declares it, and the palette and a message's keys
call typed methods: renaming one fails here, not silently as a key that does nothing."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from textual.actions import parse
from textual.app import App
from textual.binding import Binding
from textual.dom import DOMNode

import pagedchat.tui
from pagedchat.backends.local import LocalBackend
from pagedchat.tui.app import PagedChatApp, binding_catalogue
from pagedchat.tui.inspector import InspectorView
from pagedchat.tui.chat_widgets import MessageActions, MessageView, PromptInput
from pagedchat.tui.chat_view import ChatView
from pagedchat.tui.screens.compare import CompareScreen
from tui_support import ScriptedEngine, make_config, notices, quick_pilot, wait_for  # noqa: F401 (quick_pilot: autouse)


def tui_classes() -> list[type[DOMNode]]:
    """Every widget, screen and app class defined in pagedchat.tui."""
    found = []
    for info in pkgutil.walk_packages(pagedchat.tui.__path__, "pagedchat.tui."):
        module = importlib.import_module(info.name)
        found += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, DOMNode) and cls.__module__ == module.__name__]
    return found


def test_the_walk_finds_the_classes_with_keys():
    assert {PagedChatApp, ChatView, PromptInput, MessageView, CompareScreen} <= set(tui_classes())


@pytest.mark.parametrize("cls", [c for c in tui_classes() if c.__dict__.get("BINDINGS")], ids=lambda c: c.__name__)
def test_every_binding_runs_a_method_of_its_owner(cls):
    for binding in cls.__dict__["BINDINGS"]:
        assert isinstance(binding, Binding), f"{cls.__name__}: {binding!r} is not a Binding"
        namespace, name, _ = parse(binding.action)
        owner = App if namespace == "app" else cls
        assert callable(getattr(owner, f"action_{name}", None)), \
            f"{cls.__name__}: {binding.key} runs {binding.action!r}, which names no action_{name} method"


def test_the_chat_does_every_key_on_its_messages():
    wanted = [name for name, _ in inspect.getmembers(MessageActions, inspect.isfunction) if not name.startswith("_")]
    assert "copy_message" in wanted and "branch_from" in wanted
    for name in wanted:
        assert inspect.signature(getattr(ChatView, name)).parameters.keys() == \
            inspect.signature(getattr(MessageActions, name)).parameters.keys(), name


def test_every_binding_id_a_config_may_name_is_kept():
    """config.toml's [keys] rebinds these ids (docs/app.md#key-bindings): a user's file must keep working."""
    assert {b.id for b in binding_catalogue()} >= {
        "quit", "new_chat", "close_chat", "help", "toggle_inspector", "chat_settings", "rename_chat", "next_chat",
        "prev_chat", "regenerate", "branch", "export_chat", "compare", "delete_chat", "stop", "focus_messages",
        "newline", "message.copy", "message.copy_code", "message.branch", "message.edit", "message.regenerate"}


async def test_a_binding_textual_never_reports_keeps_the_default_with_a_warning(tmp_path):
    """`new_chat = "ctrl+ctrl+zz"` was taken as it stood: ctrl+n stopped opening chats and nothing said why."""
    config = make_config(tmp_path, keys={"new_chat": "ctrl+ctrl+zz", "toggle_inspector": "f9"})
    app = PagedChatApp(config, backend_factory=lambda progress: LocalBackend(ScriptedEngine([])))
    async with app.run_test(notifications=True) as pilot:
        await wait_for(pilot, lambda: app.sessions, "a chat")
        await wait_for(pilot, lambda: any("ctrl+ctrl+zz" in n for n in notices(app)), "the warning")
        assert any(n.startswith("config.toml [keys] new_chat (New) = 'ctrl+ctrl+zz': a modifier is given twice")
                   and n.endswith("it stays on ctrl+n") for n in notices(app)), notices(app)
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: len(app.sessions) == 2, "ctrl+n to open a chat")
        await pilot.press("f9")   # a good binding beside it is still taken
        assert app.query_one(InspectorView).display
