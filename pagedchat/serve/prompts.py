"""Chat prompts for HTTP clients that reuse the exact token ids of the turns this server generated.

An HTTP client sends the whole chat each turn, as text. Re-tokenizing a reply's text need not give back the ids
the model generated, and the prefix cache then misses from the first difference on. So the server remembers,
for each exchange it answered, the ids behind "the rendered prompt + the reply's text", and builds the next
turn's prompt on them (pagedchat.engine.chat.chat_prompt_ids) when the client sends that exchange back.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict

from pagedchat.engine.chat import chat_prompt_ids, render_chat
from pagedchat.serve.protocol import ApiError


def _key(rendered_prompt: str, reply_text: str) -> bytes:
    return hashlib.sha256(rendered_prompt.encode() + b"\0" + reply_text.encode()).digest()


class ExchangeMemory:
    """A bounded LRU map from (rendered prompt, reply text) to the exchange's token ids. Thread-safe: prompts
    are built on worker threads, and replies remembered on the event loop."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._ids: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, rendered_prompt: str, reply_text: str, ids: list[int]) -> None:
        key = _key(rendered_prompt, reply_text)
        with self._lock:
            self._ids[key] = array("i", ids)   # 4 bytes an id, where a list of ints takes about 36
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def recall(self, rendered_prompt: str, reply_text: str) -> list[int] | None:
        key = _key(rendered_prompt, reply_text)
        with self._lock:
            ids = self._ids.get(key)
            if ids is None:
                return None
            self._ids.move_to_end(key)
            return ids.tolist()


def build_chat_prompt(tokenizer, messages: list[dict], memory: ExchangeMemory,
                      continue_final: bool = False) -> tuple[list[int], str]:
    """The prompt ids for messages, and their rendered text (the key under which to remember the reply).
    continue_final: the last message is an assistant reply to go on with (vLLM's continue_final_message)."""
    if not tokenizer.chat_template:
        raise ApiError(400, "this model has no chat template: send a plain prompt to /v1/completions",
                       param="messages")
    previous = None
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
    if last > 0:  # an exchange before the last assistant message may be one this server answered
        previous = memory.recall(render_chat(tokenizer, messages[:last]), messages[last]["content"])
    return (chat_prompt_ids(tokenizer, messages, previous, continue_final),
            render_chat(tokenizer, messages, continue_final))
