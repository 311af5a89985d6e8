"""Only the chat template's own markers become control tokens: text from a message (a user's, a tool's
description, a tool's result) is tokenized as plain text, as OpenAI does.

A template writes its markers (`<|im_start|>`, `<|im_end|>`) as text, and a tokenizer turns every special
token's text into that token wherever it stands: a message holding `<|im_end|>\\n<|im_start|>system` would open
a system turn of its own. So before the template renders, each special token's text in a message is swapped for
a placeholder that the template passes through as it would the text (a private-use character around an index:
no whitespace to trim, no markup); after it renders, the text is put back and its span remembered as plain. The
prompt is then cut only at the template's own markers, and everything between them is tokenized with special
tokens read as text. Messages with no special token's text render and tokenize exactly as they always did.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

# Where placeholders' marks are drawn from: Supplementary Private Use Area-A, which no template or tokenizer
# gives a meaning. The first one absent from every message and the template is used.
_MARKS = range(0xF0000, 0xFFFFE)


@dataclass(frozen=True)
class Specials:
    """A tokenizer's control tokens: their texts (longest first, so that no text matches inside a longer one)
    and ids."""

    texts: tuple[str, ...]
    ids: tuple[int, ...]

    @functools.cached_property
    def pattern(self) -> re.Pattern | None:
        return re.compile("|".join(map(re.escape, self.texts))) if self.texts else None

    @functools.cached_property
    def id_of(self) -> dict[str, int]:
        return dict(zip(self.texts, self.ids))


@functools.lru_cache(maxsize=8)
def specials_of(tokenizer) -> Specials:
    """The added tokens marked special (transformers' and pagedchat's tokenizers both name them so)."""
    found = sorted(((t.content, i) for i, t in tokenizer.added_tokens_decoder.items() if t.special and t.content),
                   key=lambda pair: -len(pair[0]))
    return Specials(tuple(text for text, _ in found), tuple(i for _, i in found))


@dataclass(frozen=True)
class Rendered:
    """A rendered chat. markers: the template's own control tokens as (start, end, id) in text, in order; None
    where no message held a special token's text, so that the whole text is tokenized as before."""

    text: str
    markers: tuple[tuple[int, int, int], ...] | None = None


def _map_strings(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: v if k == "role" else _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() if k != "role" for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


@dataclass(frozen=True)
class Guarded:
    """Messages ready for the template: each special token's text in them swapped for mark, index, mark (mark is
    None where they held none, and the messages are the caller's own)."""

    messages: list[dict]
    mark: str | None
    specials: Specials

    @classmethod
    def of(cls, messages: list[dict], specials: Specials, template: str) -> "Guarded":
        strings = _strings(messages)
        if specials.pattern is None or not any(specials.pattern.search(s) for s in strings):
            return cls(messages, None, specials)
        mark = next(m for m in map(chr, _MARKS) if m not in template and not any(m in s for s in strings))
        index = {text: i for i, text in enumerate(specials.texts)}
        swap = functools.partial(specials.pattern.sub, lambda m: f"{mark}{index[m.group()]}{mark}")
        return cls(_map_strings(messages, swap), mark, specials)

    def restore(self, text: str) -> Rendered:
        """The template's output with the messages' texts put back, and where the template's markers stand."""
        if self.mark is None:
            return Rendered(text)
        pattern = self.specials.pattern
        placeholder = re.compile(f"{re.escape(self.mark)}(\\d+){re.escape(self.mark)}")
        parts: list[str] = []
        markers: list[tuple[int, int, int]] = []
        size = 0

        def template_text(chunk: str) -> None:   # the template's own text: its markers are control tokens
            nonlocal size
            for m in pattern.finditer(chunk):
                markers.append((size + m.start(), size + m.end(), self.specials.id_of[m.group()]))
            parts.append(chunk)
            size += len(chunk)

        at = 0
        for m in placeholder.finditer(text):
            template_text(text[at:m.start()])
            plain = self.specials.texts[int(m.group(1))]
            parts.append(plain)
            size += len(plain)
            at = m.end()
        template_text(text[at:])
        return Rendered("".join(parts), tuple(markers))
