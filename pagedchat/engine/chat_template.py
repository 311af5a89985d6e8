"""Chat prompts as token ids that keep earlier turns byte-identical, so they hit the prefix cache."""

from __future__ import annotations

from pagedchat.engine.markers import Guarded, Rendered, specials_of
from pagedchat.errors import RequestError, first_line

# Prompts are tokenized up to this many contexts' worth of tokens: past it a prompt is only "more than" that. A
# text of megabytes would otherwise become a list of millions of ids, built holding the interpreter lock.
COUNTED_CONTEXTS = 4


def count_limit(context: int) -> int:
    return COUNTED_CONTEXTS * context


def prompt_size(count: int, context: int) -> str:
    """A prompt's token count as a message says it: tokenized at most count_limit + 1, so past it "more than"."""
    return f"more than {count_limit(context)}" if count > count_limit(context) else str(count)


def fold_system(messages: list[dict]) -> list[dict]:
    """The messages for a template with no system role (a family's quirk, model/family.py): the system prompt
    opens the first user turn, followed by a blank line, as Gemma's own template writes it."""
    if not messages or messages[0].get("role") != "system":
        return list(messages)
    system, rest = messages[0], list(messages[1:])
    if rest and rest[0].get("role") == "user":
        return [{**rest[0], "content": f"{system['content']}\n\n{rest[0]['content']}"}] + rest[1:]
    return [{"role": "user", "content": system["content"]}] + rest


def render_chat(tokenizer, messages: list[dict], continue_final: bool = False, system_role: bool = True) -> str:
    """The template's text; continue_final: the last (assistant) message is left open for the model to go on
    with, instead of closed and followed by a new assistant turn (how a fork over HTTP continues a reply).
    system_role=False: the model's family has none (see fold_system)."""
    messages = list(messages) if system_role else fold_system(messages)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=not continue_final,
                                         continue_final_message=continue_final, tokenize=False)


def encode_up_to(tokenizer, text: str, max_length: int | None, add_special_tokens: bool = True,
                 split_special_tokens: bool = False) -> list[int]:
    """text's first max_length ids (all of them for None). pagedchat's own tokenizer (model/tokenizer.py) builds
    no more; transformers' builds them all (its truncation setting is shared state, unsafe across threads).
    split_special_tokens: special tokens' text is read as text (what a user wrote), not as those tokens."""
    kwargs = {"add_special_tokens": add_special_tokens, "split_special_tokens": split_special_tokens}
    if max_length is None:
        return tokenizer.encode(text, **kwargs)
    head = getattr(tokenizer, "encode_head", None)
    if head is not None:
        return head(text, max(max_length, 1), **kwargs)
    return tokenizer.encode(text, **kwargs)[:max(max_length, 1)]


def encode_rendered(tokenizer, rendered: Rendered, start: int = 0, max_length: int | None = None) -> list[int]:
    """The ids of rendered.text[start:]: control tokens only at the template's own markers (engine/markers.py)."""
    if rendered.markers is None:
        return encode_up_to(tokenizer, rendered.text[start:], max_length, add_special_tokens=False)
    max_length = None if max_length is None else max(max_length, 1)
    ids: list[int] = []

    def plain(end: int | None) -> None:
        left = None if max_length is None else max_length - len(ids)
        ids.extend(encode_up_to(tokenizer, rendered.text[start:end], left, add_special_tokens=False,
                                split_special_tokens=True))

    for begin, end, token in rendered.markers:
        if begin < start:
            continue
        plain(begin)
        ids.append(token)
        start = end
        if max_length is not None and len(ids) >= max_length:
            return ids[:max_length]
    plain(None)
    return ids if max_length is None else ids[:max_length]


def chat_prompt_ids(tokenizer, messages: list[dict], previous_ids: list[int] | None = None,
                    continue_final: bool = False, system_role: bool = True,
                    max_length: int | None = None) -> list[int]:
    """The prompt for `messages`, reusing previous_ids (an earlier turn's prompt plus the ids it generated):
    every chat becomes ids here. Raises RequestError when the model has no template or it refuses them. Only the
    template's own markers become control tokens; the messages' text is plain text (engine/markers.py).

    Re-tokenising a reply's text need not give back the ids the model generated, and then nothing after the
    first difference hits the cache. So when the template renders the earlier ids' text unchanged as a
    prefix, those exact ids are kept and only the new text is tokenised. max_length: at most this many ids (a
    caller that refuses longer prompts anyway need not build a list of millions).
    """
    if not tokenizer.chat_template:
        raise RequestError("this model has no chat template, so it takes a plain-text prompt, not chat messages")
    guarded = Guarded.of(messages, specials_of(tokenizer), tokenizer.chat_template)
    try:
        rendered = guarded.restore(render_chat(tokenizer, guarded.messages, continue_final, system_role))
    except Exception as exc:  # the template refuses these messages (a role it does not know, ...)
        raise RequestError(f"the chat template cannot render these messages: {first_line(exc)}") from exc
    previous_ids = list(previous_ids or ())
    kept, before = kept_prefix(tokenizer, previous_ids, rendered.text)
    rest = None if max_length is None else max_length - kept
    return previous_ids[:kept] + encode_rendered(tokenizer, rendered, len(before), rest)


def kept_prefix(tokenizer, ids: list[int], text: str) -> tuple[int, str]:
    """How many of ids, from the first, to keep before text, and their text: all of them where it begins text;
    else the most whose text does (a reply the client sent back changed, trimmed by the template, or a character
    whose bytes the model split decoded otherwise), so the pages before the difference still hit the cache.
    (0, "") when none do."""
    def decoded(n: int) -> str:
        return tokenizer.decode(ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def starts(n: int) -> bool:
        # A prefix that ends inside a character decodes it as U+FFFD: left out, so that the search goes on past.
        return text.startswith(decoded(n).rstrip("\ufffd"))

    if not ids:
        return 0, ""
    whole = decoded(len(ids))
    if text.startswith(whole):
        return len(ids), whole
    good, bad = 0, len(ids)   # starts(good); not starts(bad)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if starts(mid) else (good, mid)
    # Kept ids must end on a whole character, their text exactly a prefix: the rest is encoded from the text.
    before = decoded(good)
    while good > 0 and not text.startswith(before):
        good -= 1
        before = decoded(good)
    return good, before
