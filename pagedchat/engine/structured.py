"""Constrained decoding: grammars compiled by llguidance over the model's tokenizer (the sampler applies their
masks: sampling.py). Free of torch, so the server can plan and compile grammars without the engine's modules.

A grammar is compiled once per distinct source (cached) on the caller's thread, never on the engine's: the
engine only copies the compiled matcher for each request (cheap) and, each step, asks it for the next token's
bitmask and tells it the token sampled. JSON is compiled compact (no free whitespace), so a small model cannot
wander into endless blank space inside an object.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

import numpy as np

from pagedchat.errors import RequestError

# Compiled grammars kept for reuse: a server sees the same few schemas over and over.
CACHE_SIZE = 128
_JSON_OPTIONS = {"whitespace_flexible": False}
# Free choices a new grammar is walked through before it is accepted (see first_failure).
PROBE_CHOICES = 32
# llguidance's parser limits, by the words of the error each one raises.
_LIMITS = (("items; max is", "max_items_in_row"), ("Too many items", "step_max_items"))


class GrammarKind(Enum):
    JSON_SCHEMA = "json_schema"   # source: a JSON schema, as JSON text
    LARK = "lark"                 # source: a Lark grammar (llguidance's dialect, which can embed %json)
    REGEX = "regex"


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain a reply to, before it is compiled."""

    kind: GrammarKind
    source: str

    @classmethod
    def json_schema(cls, schema: dict) -> "GrammarSpec":
        # Keys keep their order: the reply writes an object's properties in the order the schema lists them.
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema))

    def llguidance_grammar(self) -> str:
        from llguidance import LLMatcher

        if self.kind is GrammarKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(self.source, overrides=_JSON_OPTIONS)
        if self.kind is GrammarKind.LARK:
            return LLMatcher.grammar_from_lark(self.source)
        return LLMatcher.grammar_from_regex(self.source)


def json_rule(schema: dict) -> str:
    """schema as the body of a rule in a LARK grammar (llguidance's `%json`), as compact as a JSON_SCHEMA one."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled grammar: a matcher at its start, which each request copies."""

    spec: GrammarSpec
    start: object   # llguidance.LLMatcher, never advanced

    def matcher(self):
        return self.start.deep_copy()


class GrammarCompiler:
    """Compiles grammars over one tokenizer, with an LRU cache; safe to call from any thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._ll = None
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def _lltokenizer(self):
        """llguidance's view of the tokenizer (built once: it walks the whole vocabulary)."""
        if self._ll is None:
            import llguidance
            import tokenizers

            # pagedchat's FastTokenizer holds the tokenizers-library backend; transformers' fast tokenizer too.
            backend = getattr(self._tokenizer, "backend", None)
            if not isinstance(backend, tokenizers.Tokenizer):
                backend = self._tokenizer.backend_tokenizer
            self._ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=self._vocab_size, eos_token=self._eos)
        return self._ll

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar, or RequestError saying why the grammar or schema is refused."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            ll = self._lltokenizer()
        try:
            from llguidance import LLMatcher
        except ImportError as exc:
            raise RequestError("constrained decoding needs llguidance: pip install 'pagedchat[serve]'") from exc
        try:
            grammar = spec.llguidance_grammar()
        except ValueError as exc:
            raise RequestError(f"invalid {spec.kind.value}: {exc}") from None
        start = LLMatcher(ll, grammar, log_level=0)
        if start.is_error():
            raise RequestError(f"invalid {spec.kind.value}: {start.get_error()}")
        failure = first_failure(start, self._vocab_size, self._eos)
        if failure is not None:
            raise RequestError(f"invalid {spec.kind.value}: {failure}")
        compiled = CompiledGrammar(spec, start)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def first_failure(start, vocab_size: int, eos: int | None) -> str | None:
    """Why a compiled grammar fails in its first tokens, or None.

    llguidance checks its limits (the items in a parser row, the work of one step) only as it parses, and a
    grammar that admits no text (a "$ref" cycle that never reaches a value) compiles too: either would fail in
    mid-reply, or end it empty as if complete. So a new grammar is walked before any reply uses it: its forced
    tokens, then the lowest-numbered token it allows other than the end (a byte, in byte-level vocabularies:
    what opens objects, keys and strings), PROBE_CHOICES times or until only the end is left."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    walker = start.deep_copy()
    mask = allocate_token_bitmask(1, vocab_size)
    for _ in range(PROBE_CHOICES):
        walker.consume_tokens(walker.compute_ff_tokens())
        fill_next_token_bitmask(walker, mask, 0)   # as the sampler does
        if walker.is_error():
            return _why(walker.get_error())
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size])
        choices = allowed[allowed != eos] if eos is not None else allowed
        if len(choices) == 0:
            return None if walker.is_accepting() else "it admits no text"
        if not walker.consume_token(int(choices[0])):
            return _why(walker.get_error())
    return None


def _why(error: str) -> str:
    """llguidance's error, its first line only (the rest is its parser's state), with the limit it names."""
    line = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if line.startswith("NoExtensionBias"):
        return "it admits no text (is it a \"$ref\" cycle that never reaches a value?)"
    limit = next((name for words, name in _LIMITS if words in line), None)
    return f"too complex for llguidance's {limit} limit ({line})" if limit else line
