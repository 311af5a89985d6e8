"""The model's tokenizer without transformers at start: a record of the tokenizer transformers builds for a folder,
read back into the `tokenizers` library's Tokenizer, with the chat template rendered by jinja2 as transformers does.

Importing transformers costs more than everything else a start does beside torch
(docs/bench.md#start-up-without-transformers). So at a folder's first load transformers' own tokenizer is built
once, and what it encodes and renders with is saved as a record in the cache: its backend exactly as transformers
configured it (added tokens, post-processor, normalizer), its special tokens and its chat template. The record is
checked against transformers on probe texts and chats before it is saved; every later start reads it. A tokenizer
the record cannot stand for (a class with its own Python encode or decode, a decode that would clean up spaces, a
template the probes render differently) stays transformers' own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path

import tokenizers

from pagedchat import paths

log = logging.getLogger(__name__)
FORMAT = "1"
BACKEND_FILE = "tokenizer.json"
META_FILE = "pagedchat.json"
# The kinds of file a tokenizer is read from (configs, vocabularies, templates, sentencepiece and tiktoken models),
# whose contents key a folder's record; weights (GBs) are never read for it. pagedchat's own pointer is left
# out too, so a record made while a GGUF is converted serves the finished folder.
_TOKENIZER_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".vocab")
_OWN_FILES = ("gguf.json",)  # gguf.GGUF_POINTER (gguf.py imports this module)
# transformers' methods that encode and decode; a tokenizer class overriding any of them is not reproduced here.
_CODEC_METHODS = ("encode", "decode", "_decode", "_encode_plus", "apply_chat_template", "tokenize")
# Names transformers copies a message's reasoning under, so templates reading either name see it.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True)
class TokenizerMeta:
    """What a record holds beside the backend: what transformers' tokenizer reads outside tokenizer.json."""

    chat_template: str | None
    special_tokens: dict[str, str]   # bos_token, eos_token...: the chat template sees these
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    split_special_tokens: bool


# encode_head first tokenizes a prefix of this many characters per token wanted, and a few tokens more.
_HEAD_CHARS_PER_TOKEN = 16
_PAST_THE_CUT = 16


class FastTokenizer:
    """The part of transformers' tokenizer API pagedchat uses, with the same ids, text and rendered chats."""

    def __init__(self, backend: tokenizers.Tokenizer, meta: TokenizerMeta):
        # transformers' encode() never truncates or pads, whatever tokenizer.json asks for.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = meta.split_special_tokens
        self.backend = backend
        self.meta = meta
        self.chat_template = meta.chat_template
        self.bos_token_id, self.eos_token_id = meta.bos_token_id, meta.eos_token_id
        self.pad_token_id = meta.pad_token_id

    @property
    def added_tokens_decoder(self) -> dict[int, tokenizers.AddedToken]:
        """The added tokens by id, as transformers' tokenizer names them (.special: a control token)."""
        return self.backend.get_added_tokens_decoder()

    @functools.cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads special tokens' text as text (transformers' split_special_tokens): a
        copy, since the flag is the backend's state and prompts are tokenized on several threads."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.no_truncation()
        plain.no_padding()
        plain.encode_special_tokens = True
        return plain

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        return self._ids(text, add_special_tokens, split_special_tokens)

    def encode_head(self, text: str, max_length: int, add_special_tokens: bool = True,
                    split_special_tokens: bool = False) -> list[int]:
        """encode(text)[:max_length], without building all of a long text's ids.

        A text of megabytes is millions of ids, whose list and encoding are built and freed holding the
        interpreter lock. A prefix holding well over max_length tokens gives the same first ids: the
        pre-tokenizer splits words where they stand, so only the last few differ at its cut."""
        head_chars = _HEAD_CHARS_PER_TOKEN * (max_length + _PAST_THE_CUT)
        head = self._ids(text[:head_chars], add_special_tokens, split_special_tokens)
        if len(text) <= head_chars or len(head) > max_length + _PAST_THE_CUT:
            return head[:max_length]
        return self._ids(text, add_special_tokens, split_special_tokens)[:max_length]

    def _ids(self, text: str, add_special_tokens: bool, split_special_tokens: bool) -> list[int]:
        # The batch call, for one text: it releases the interpreter lock while it runs (encode holds it), so a long
        # prompt tokenized on a worker thread does not stop the server's event loop.
        backend = self._plain if split_special_tokens and not self.meta.split_special_tokens else self.backend
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        # A record is saved only where transformers' decode cleans up no spaces (the probes check it): BPE in
        # transformers 5, whatever the flag.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = False) -> str:
        """The chat rendered as text (tokenize=False only: encode it with add_special_tokens=False)."""
        if tokenize:
            raise TypeError("FastTokenizer.apply_chat_template renders text: pass tokenize=False, then encode()")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        return render_chat_template(self.chat_template, conversation, self.meta.special_tokens,
                                    add_generation_prompt, continue_final_message)


# ---- rendering: transformers' chat_template_utils, for plain messages of text -------------------------------------


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    """The template in transformers' sandboxed environment (its filters and globals; no {% generation %} tag).
    jinja2 is imported here, at a chat's first render, not at start."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateNamespace(jinja2.utils.Namespace):
        # As transformers': namespaces refuse underscore names, the way into CPython internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=TemplateNamespace, dict=lambda *a, **k: dict(*a, **k))
    return env.from_string(source)


def _template_message(message: dict) -> dict:
    """A message as transformers hands it to a template: None values dropped, reasoning under every name."""
    out = {str(k): v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def render_chat_template(source: str, messages: list[dict], special_tokens: dict[str, str],
                         add_generation_prompt: bool, continue_final_message: bool) -> str:
    """What transformers' apply_chat_template(tokenize=False) renders for these messages."""
    chat = [_template_message(m) for m in messages]
    if continue_final_message:
        if not chat or chat[-1].get("content") is None:
            raise ValueError("continue_final_message is set but the final message has no content to continue")
        if "content" not in source:
            raise ValueError("continue_final_message is set but this chat template does not read content")
        final = chat[-1]["content"]
        chat[-1] = {**chat[-1], "content": final + _CONTINUE_TAG}
    text = _compile(source).render(messages=chat, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **special_tokens)
    if continue_final_message:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ValueError("continue_final_message is set but the template dropped part of the final message")
        at = text.rindex(_CONTINUE_TAG.strip())
        # A template that keeps spacing keeps the tag whole; one that trimmed it also trimmed the message's end.
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


# ---- the record: made from transformers' tokenizer, checked, kept in the cache -----------------------------------

# What a record is checked on before it is saved: texts with special tokens, spacing and non-ASCII, and chats
# with and without a system prompt, a generation prompt, and a final message to continue.
_PROBE_TEXTS = ["", "Hello world", "  two  spaces\tand a tab\n\nnew lines ", "naïve café — 日本語 🙂",
                "<|im_start|>user\nhi<|im_end|>", "</s><s>[INST] x [/INST]<|endoftext|>", "def f(x):\n    return x",
                "Yes . No , so ! Why ? I do n't , it 's"]  # what a decode that cleans up spaces would change
_PROBE_CHATS = [
    ([{"role": "user", "content": "What is 2+2?"}], True, False),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <b>&</b>\n"},
      {"role": "assistant", "content": " Hello!  "}, {"role": "user", "content": "naïve 🙂"}], True, False),
    ([{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon"}], False, True),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], False, False),
]


def record_key(folder: Path) -> str:
    """What names a folder's record: its tokenizer-shaping files' contents and the versions that read them."""
    h = hashlib.sha256(json.dumps([FORMAT, metadata.version("transformers"), tokenizers.__version__]).encode())
    folder = Path(folder)
    files = [p for p in folder.iterdir() if p.is_file() and p.name.endswith(_TOKENIZER_SUFFIXES)
             and p.name not in _OWN_FILES]
    files += list((folder / "additional_chat_templates").glob("*"))
    for path in sorted(files):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:32]


def record_dir(folder: Path) -> Path:
    return paths.cache_dir() / "tokenizers" / record_key(folder)


def read_record(where: Path) -> FastTokenizer | None:
    """The tokenizer a record holds, or None where there is none or it cannot be read (then it is made again)."""
    if not (where / META_FILE).is_file():
        return None
    try:
        meta = TokenizerMeta(**json.loads((where / META_FILE).read_text()))
        return FastTokenizer(tokenizers.Tokenizer.from_file(str(where / BACKEND_FILE)), meta)
    except Exception as exc:  # a cut-off or foreign file: json, dataclass and tokenizers raise their own errors
        log.warning("ignoring unreadable tokenizer record %s: %s", where, exc)
        return None


def from_transformers(hf) -> FastTokenizer | None:
    """A FastTokenizer standing for transformers' tokenizer hf, or None where it cannot (see the module doc)."""
    try:
        from transformers import TokenizersBackend as Fast
    except ImportError:  # transformers 4: the same role under its older name
        from transformers import PreTrainedTokenizerFast as Fast

    if not isinstance(hf, Fast) or type(hf.backend_tokenizer.model).__name__ != "BPE":
        return None
    if any(getattr(type(hf), name) is not getattr(Fast, name) for name in _CODEC_METHODS):
        return None
    template = hf.chat_template if isinstance(hf.chat_template, str) else None
    meta = TokenizerMeta(template, dict(hf.special_tokens_map), hf.bos_token_id, hf.eos_token_id, hf.pad_token_id,
                         bool(getattr(hf, "split_special_tokens", False)))
    fast = FastTokenizer(tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str()), meta)
    return fast if _same(fast, hf) else None


def _outcome(render):
    try:
        return render()
    except Exception as exc:  # both must refuse the same chats; the message's wording may differ
        return type(exc)


def _same(fast: FastTokenizer, hf) -> bool:
    for text in _PROBE_TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            if fast.encode(text, add_special_tokens=special) != ids:
                return False
            if any(fast.decode(ids, skip_special_tokens=s) != hf.decode(ids, skip_special_tokens=s)
                   for s in (False, True)):
                return False
    if fast.chat_template is None:
        return hf.chat_template is None
    for chat, generation, cont in _PROBE_CHATS:
        kwargs = dict(add_generation_prompt=generation, continue_final_message=cont, tokenize=False)
        if _outcome(lambda: fast.apply_chat_template(chat, **kwargs)) != \
                _outcome(lambda: hf.apply_chat_template(chat, **kwargs)):
            return False
    return True


def record(folder: Path, hf) -> FastTokenizer | None:
    """Make and save the folder's record from transformers' tokenizer hf; None where a record cannot stand for it."""
    fast = from_transformers(hf)
    if fast is not None:
        write_record(record_dir(folder), fast)
    return fast


def write_record(where: Path, fast: FastTokenizer) -> None:
    """Save a record atomically (a temporary folder, then a rename): a crash leaves no half record."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{where.name}.", dir=where.parent))
        try:
            fast.backend.save(str(tmp / BACKEND_FILE))
            (tmp / META_FILE).write_text(json.dumps(asdict(fast.meta)) + "\n")
            os.replace(tmp, where)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:  # a full or read-only disk, or another process saved it first: the next start is slower
        if not (where / META_FILE).is_file():
            log.warning("could not save the tokenizer record %s: %s", where, exc)
