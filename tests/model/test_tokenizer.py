"""The tokenizer record (pagedchat/model/tokenizer.py): the same ids, text and rendered chats as transformers'
own tokenizer, read at later starts without importing transformers."""

from __future__ import annotations

import functools
import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_gguf import write_tiny_gguf
from tiny_models import make_tiny_model
from transformers import AutoTokenizer

from pagedchat.engine.chat_template import chat_prompt_ids, encode_up_to
from pagedchat.model.gguf import convert_gguf
from pagedchat.model.loader import load_tokenizer
from pagedchat.model.tokenizer import FastTokenizer, from_transformers, record_dir

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi <|im_end|> there\n\n"},
     {"role": "assistant", "content": "  Hello! 🙂 naïve"}, {"role": "user", "content": "tabs\tand {{ braces }}"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "x", "name": None}],
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDCHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A tiny safetensors folder (transformers' plain fast tokenizer) and one converted from a GGUF."""
    tmp = tmp_path_factory.mktemp("tok")
    src = make_tiny_model(tmp / "src")
    return {"safetensors": src, "gguf": convert_gguf(write_tiny_gguf(src, tmp / "tiny.gguf"), tmp / "out")}


def hf_chat_ids(hf, chat, **kwargs) -> list[int]:
    return hf.apply_chat_template(chat, tokenize=True, return_dict=False, **kwargs)


def assert_same_as_transformers(ours: FastTokenizer, hf) -> None:
    assert isinstance(ours, FastTokenizer)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id,
                                                                         hf.pad_token_id)
    assert ours.chat_template == hf.chat_template
    for chat in CHATS:
        prompt = ours.apply_chat_template(chat, add_generation_prompt=True)
        assert prompt == hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.encode(prompt, add_special_tokens=False) == hf_chat_ids(hf, chat, add_generation_prompt=True)
        if chat[-1]["role"] == "assistant":
            assert ours.apply_chat_template(chat, continue_final_message=True) == \
                hf.apply_chat_template(chat, continue_final_message=True, tokenize=False)
        # The next turn built on the previous ids, as the app and the server build it.
        previous = hf_chat_ids(hf, chat[:1], add_generation_prompt=True)
        assert chat_prompt_ids(ours, chat, previous) == chat_prompt_ids(hf, chat, previous)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_the_record_renders_and_encodes_as_transformers_does(kind, tiny_folders, cache):
    folder = tiny_folders[kind]
    first = load_tokenizer(folder)  # made from transformers' tokenizer, and saved
    assert (record_dir(folder) / "pagedchat.json").is_file()
    hf = AutoTokenizer.from_pretrained(folder)
    assert_same_as_transformers(first, hf)
    assert_same_as_transformers(load_tokenizer(folder), hf)  # read back from the record


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.sampled_from(list("ab xy\n\t.é日🙂") + ["<|im_end|>", "<|im_start|>", "fox"]),
                     max_size=30).map("".join), special=st.booleans(), split=st.booleans())
def test_any_text_encodes_and_decodes_as_transformers_does(tiny_folders, text, special, split):
    """split: special tokens' text read as text (transformers' split_special_tokens), as a user's text is."""
    hf, ours = _pair(tiny_folders["safetensors"])
    ids = hf.encode(text, add_special_tokens=special, split_special_tokens=split)
    assert ours.encode(text, add_special_tokens=special, split_special_tokens=split) == ids
    assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@settings(max_examples=60, deadline=None)
@given(text=st.lists(st.sampled_from(list("ab xy\n\t.é日🙂") + ["<|im_end|>", "fox", "  "]), max_size=400).map("".join),
       max_length=st.integers(1, 120), special=st.booleans(), split=st.booleans())
def test_encode_head_keeps_transformers_first_ids(tiny_folders, text, max_length, special, split):
    """Past a short prefix the record tokenizes only a head of the text (a megabyte prompt stays cheap to
    refuse); its first max_length ids are still transformers' own."""
    hf, ours = _pair(tiny_folders["safetensors"])
    want = hf.encode(text, add_special_tokens=special, split_special_tokens=split)[:max_length]
    assert ours.encode_head(text, max_length, add_special_tokens=special, split_special_tokens=split) == want
    for tokenizer in (hf, ours):   # transformers' has no encode_head: all its ids, cut
        assert encode_up_to(tokenizer, text, max_length, add_special_tokens=special,
                            split_special_tokens=split) == want


@functools.lru_cache(maxsize=None)
def _pair(folder):
    """transformers' tokenizer and the record made from it, once per folder (hypothesis calls many times)."""
    hf = AutoTokenizer.from_pretrained(folder)
    return hf, from_transformers(hf)


def test_a_converted_gguf_starts_without_transformers(tiny_folders, cache, tmp_path, monkeypatch):
    """Converting a GGUF records its tokenizer, so even the first load of the finished folder reads the record."""
    folder = convert_gguf(write_tiny_gguf(tiny_folders["safetensors"], tmp_path / "t.gguf"), tmp_path / "out")
    want = AutoTokenizer.from_pretrained(folder).encode("The quick brown fox <|im_end|>")
    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it now raises ImportError
    ours = load_tokenizer(folder)
    assert isinstance(ours, FastTokenizer) and ours.encode("The quick brown fox <|im_end|>") == want


def test_a_damaged_record_is_made_again(tiny_folders, cache):
    folder = tiny_folders["safetensors"]
    load_tokenizer(folder)
    (record_dir(folder) / "tokenizer.json").write_text("{ cut off")
    again = load_tokenizer(folder)
    assert_same_as_transformers(again, AutoTokenizer.from_pretrained(folder))
    assert isinstance(load_tokenizer(folder), FastTokenizer)


def test_a_changed_template_gets_a_record_of_its_own(tmp_path, cache):
    folder = make_tiny_model(tmp_path / "m")
    before = record_dir(folder)
    (folder / "tf_model.h5").write_bytes(b"weights are never read for the key")
    (folder / "gguf.json").write_text('{"file": "moved.gguf"}')  # pagedchat's pointer, rewritten when moved
    assert record_dir(folder) == before
    load_tokenizer(folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                                                "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    assert record_dir(folder) != before
    ours = load_tokenizer(folder)
    assert ours.apply_chat_template(CHATS[0], add_generation_prompt=True) == \
        "[user] What is the capital of France?\n[assistant] "


def test_a_template_the_record_cannot_render_stays_transformers(tmp_path, cache):
    """transformers' {% generation %} tag (assistant masks) is not in the record's renderer: the probes catch
    it, and that model keeps transformers' own tokenizer."""
    folder = make_tiny_model(tmp_path / "m")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{% generation %}{{ m['content'] }}"
                                                "{% endgeneration %}{% endfor %}")
    tok = load_tokenizer(folder)
    assert not isinstance(tok, FastTokenizer) and tok.apply_chat_template(CHATS[0], tokenize=False) == \
        CHATS[0][0]["content"]
    assert not record_dir(folder).exists()


@pytest.mark.slow
def test_the_default_models_record_matches_transformers(default_model, cache):
    hf = AutoTokenizer.from_pretrained(default_model)
    ours = load_tokenizer(default_model)
    assert_same_as_transformers(ours, hf)
    assert_same_as_transformers(load_tokenizer(default_model), hf)


def test_a_decode_that_cleans_up_spaces_stays_transformers(tmp_path, cache):
    """transformers cleans up spaces before punctuation where a tokenizer asks it to (forced for BPE in 5.x);
    the record's decode does not, so such a tokenizer keeps transformers' own."""
    folder = make_tiny_model(tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(clean_up_tokenization_spaces=True,
                  clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    assert not isinstance(tok, FastTokenizer) and tok.decode(tok.encode("Yes . No , so !")) == "Yes. No, so!"
    assert not record_dir(folder).exists()
