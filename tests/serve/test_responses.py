"""The finish reasons on the wire: what `pagedchat serve` sends for each, and RemoteBackend reads back."""

from __future__ import annotations

import pytest

from pagedchat.backends.remote import finish_reason_of
from pagedchat.engine.records import FinishReason
from pagedchat.serve.responses import finish_fields

FROM_A_BACKEND = [r for r in FinishReason if r is not FinishReason.INTERRUPTED]   # INTERRUPTED is the app's own


def test_each_reason_has_openais_word_and_vllms_stop_reason():
    wire = {r: (f["finish_reason"], f["stop_reason"]) for r in FROM_A_BACKEND for f in [finish_fields(r)]}
    assert wire == {FinishReason.STOP: ("stop", None), FinishReason.LENGTH: ("length", None),
                    FinishReason.CONTEXT_FULL: ("length", "context_full"),
                    FinishReason.TOOL_CALLS: ("tool_calls", None), FinishReason.CANCELLED: ("abort", None),
                    FinishReason.ERROR: ("error", None)}


def test_a_reply_that_calls_tools_finishes_with_tool_calls_unless_cut_short():
    assert finish_fields(FinishReason.STOP, calls=True)["finish_reason"] == "tool_calls"
    assert finish_fields(FinishReason.LENGTH, calls=True)["finish_reason"] == "length"


@pytest.mark.parametrize("reason", FROM_A_BACKEND)
def test_the_remote_backend_reads_back_what_the_server_sends(reason):
    fields = finish_fields(reason)
    assert finish_reason_of(fields["finish_reason"], fields["stop_reason"]) is reason


def test_other_servers_words():
    assert finish_reason_of("function_call") is FinishReason.TOOL_CALLS   # OpenAI's older word
    assert finish_reason_of("content_filter") is FinishReason.STOP         # the server's own rule ended it
    assert finish_reason_of("stop", "\n\n") is FinishReason.STOP           # vLLM's stop_reason: the stop string
