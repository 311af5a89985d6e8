"""Chats as prompt ids (engine/chat.py), the one path every caller builds them on."""

from __future__ import annotations

import pytest

from pagedchat.engine.chat import chat_prompt_ids
from pagedchat.errors import RequestError
from tiny_models import make_tokenizer

CHAT = [{"role": "user", "content": "hi"}]


def test_a_model_without_a_chat_template_takes_text_not_chats():
    tok = make_tokenizer()
    assert chat_prompt_ids(tok, CHAT)   # the same tokenizer, with its template
    tok.chat_template = None
    with pytest.raises(RequestError, match="this model has no chat template, so it takes a plain-text prompt"):
        chat_prompt_ids(tok, CHAT)


def test_a_refused_chat_is_one_line_naming_the_template():
    with pytest.raises(RequestError, match="^the chat template cannot render these messages: [^\n]+$"):
        chat_prompt_ids(make_tokenizer(), [{"role": "user", "content": None}])
