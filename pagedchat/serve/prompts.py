"""Chat prompts for HTTP clients that reuse the exact token ids of the turns this server generated.

An HTTP client sends the whole chat each turn, as text. Re-tokenizing a reply's text need not give back the ids
the model generated, and the prefix cache then misses from the first difference on. So the server remembers,
for each exchange it answered, the ids behind "the prompt's messages + the reply's text", and builds the next
turn's prompt on them (the backend's prompt_ids with `previous`) when the client sends that exchange back.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict

from pagedchat.backends.base import TokenBackend
from pagedchat.engine.records import Outcome


def _key(messages: list[dict], continue_final: bool, reply_text: str) -> bytes:
    canonical = json.dumps([messages, continue_final, reply_text], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(canonical.encode()).digest()


class ExchangeMemory:
    """A bounded LRU map from (prompt messages, reply text) to the exchange's token ids. Thread-safe: prompts
    are built on worker threads, and replies remembered on the event loop."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._ids: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, messages: list[dict], continue_final: bool, reply_text: str, ids) -> None:
        key = _key(messages, continue_final, reply_text)
        with self._lock:
            self._ids[key] = array("i", ids)   # 4 bytes an id, where a list of ints takes about 36
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def recall(self, messages: list[dict], continue_final: bool, reply_text: str) -> list[int] | None:
        key = _key(messages, continue_final, reply_text)
        with self._lock:
            ids = self._ids.get(key)
            if ids is None:
                return None
            self._ids.move_to_end(key)
            return ids.tolist()


def build_chat_prompt(backend: TokenBackend, messages: list[dict], memory: ExchangeMemory,
                      continue_final: bool = False) -> list[int]:
    """The prompt ids for messages. continue_final: the last message is an assistant reply to go on with
    (vLLM's continue_final_message). Raises PagedChatError when the template cannot render them."""
    previous = None
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=0)
    if last > 0:  # an exchange before the last assistant message may be one this server answered
        ids = memory.recall(messages[:last], False, messages[last]["content"])
        previous = Outcome(prompt_token_ids=list(ids)) if ids else None
    return backend.prompt_ids(messages, previous, continue_final=continue_final)
