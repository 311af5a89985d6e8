"""Chat prompts as token ids that keep earlier turns byte-identical, so they hit the prefix cache."""

from __future__ import annotations


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


def chat_prompt_ids(tokenizer, messages: list[dict], previous_ids: list[int] | None = None,
                    continue_final: bool = False, system_role: bool = True) -> list[int]:
    """The prompt for `messages`, reusing previous_ids (an earlier turn's prompt plus the ids it generated).

    Re-tokenising a reply's text need not give back the ids the model generated, and then nothing after the
    first difference hits the cache. So when the template renders the earlier ids' text unchanged as a
    prefix, those exact ids are kept and only the new text is tokenised.
    """
    text = render_chat(tokenizer, messages, continue_final, system_role)
    if previous_ids:
        before = tokenizer.decode(previous_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text.startswith(before):
            return list(previous_ids) + tokenizer.encode(text[len(before):], add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)
