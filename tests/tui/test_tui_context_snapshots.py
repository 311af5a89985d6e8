"""Snapshots of the context figure on the input's border: at 0% (muted), 75% (warning) and 95% (error).

The backend is the snapshot stand-in with an 8,192-token context; each chat's size comes from its saved last
reply (prompt plus generated tokens), as it does after a restart.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagedchat.tui.app import PagedChatApp
from pagedchat.engine.records import Outcome
from pagedchat.tui.conversation import ChatMessage, ChatRecord, ChatSettings
from pagedchat.tui.store import Store
from test_tui_snapshots import _loaded, stand_in
from tui_support import make_config

CONTEXT = 8192


def context_backend(progress):
    backend = stand_in(progress)
    backend.info = replace(backend.info, context_length=CONTEXT)
    return backend


def chat_at(config, used: int) -> None:
    messages = []
    if used:
        stats = Outcome(prompt_tokens=used - 200, cached_tokens=used - 216, generated_tokens=200,
                        time_to_first_token=0.05, decode_tokens_per_s=40.0, finish_reason="stop")
        messages = [ChatMessage("user", "Summarise the whole design document again."),
                    ChatMessage("assistant", "The design keeps the KV cache in pages of 16 tokens.", stats)]
    store = Store.open(config.data_dir)
    store.save_chat(ChatRecord(id="aaaaaaaaaaaa", title="Long chat", settings=ChatSettings(temperature=0.0),
                               messages=messages))
    store.close()


@pytest.mark.parametrize("used", [0, 6144, 7782], ids=["0pct", "75pct", "95pct"])
def test_context_figure(tmp_path, snap_compare, used):
    config = make_config(tmp_path, "/models/SmolLM2-135M-Instruct")
    chat_at(config, used)
    app = PagedChatApp(config, backend_factory=context_backend)
    assert snap_compare(app, terminal_size=(80, 16), run_before=_loaded)
