"""A chat's Reply on its own: its life cycle (start, feed, finish, abandon, fork) without the app or a model."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedchat.engine.records import FinishReason, Outcome, Update
from pagedchat.tui.conversation import ChatMessage, ChatSettings
from pagedchat.tui.reply import Reply


@dataclass
class Handle:
    request_id: str
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def so_far(self) -> Outcome:
        return Outcome(self.request_id, prompt_tokens=30, cached_tokens=16, time_to_first_token=0.2)


@dataclass
class ForkingBackend:
    forks: list = field(default_factory=list)

    def fork(self, parent, params, *, on_update=None):
        self.forks.append((parent.request_id, params.max_tokens))
        return Handle(f"{parent.request_id}-fork")


def test_a_reply_takes_its_own_updates_until_it_ends():
    reply = Reply()
    assert not reply.live and not reply.takes("r1")
    reply.start(Handle("r1"), index=3)
    assert reply.live and reply.takes("r1") and not reply.takes("r2")
    fed = reply.feed([Update("r1", "Hel", tokens=1, notices=("slow",)),
                      Update("r1", "lo", tokens=1, notices=("slow",))])
    assert (fed.text, fed.tokens, fed.notices, fed.outcome) == ("Hello", 2, ("slow",), None)
    assert reply.content == "Hello" and reply.tokens == 2 and reply.tokens_held() == 30 + 2

    final = Outcome("r1", text="Hello!", finish_reason="stop", prompt_tokens=30, generated_tokens=3)
    fed = reply.feed([Update("r1", "!", tokens=1, outcome=final)])
    ending = reply.finish(fed.outcome)
    assert (ending.index, ending.content, ending.stats.generated_tokens, ending.stats.finish_reason) == \
        (3, "Hello!", 3, "stop")
    assert reply.live and not reply.takes("r1")   # ended, but live until the screen shows it
    reply.end()
    assert not reply.live and reply.index is None and reply.content == "" and reply.tokens == 0


def test_abandon_cancels_and_keeps_the_figures_as_they_stand():
    reply = Reply()
    handle = Handle("r1")
    reply.start(handle, index=1)
    reply.feed([Update("r1", "partial", tokens=4)])
    ending = reply.abandon(shown="partial")
    assert handle.cancelled and not reply.takes("r1")
    assert ending.content == "partial"
    assert (ending.stats.prompt_tokens, ending.stats.generated_tokens, ending.stats.finish_reason) == \
        (30, 4, "cancelled")


def test_a_fork_continues_after_the_text_it_inherits():
    parent = Reply()
    parent.start(Handle("r1"), index=1, prefix="Once ")
    parent.feed([Update("r1", "upon", tokens=10)])
    backend = ForkingBackend()
    branch = parent.fork(backend, ChatSettings(max_tokens=64), on_update=None)
    assert backend.forks == [("r1", 54)]   # what the parent's budget has left
    assert branch.takes("r1-fork") and branch.index == 1 and branch.inheriting
    # Abandoned before its first update, it keeps the text it was shown with.
    assert branch.abandon(shown="Once upon").content == "Once upon"

    branch = parent.fork(backend, ChatSettings(max_tokens=64), on_update=None)
    fed = branch.feed([Update("r1-fork", " a time", tokens=2, inherited="upon")])
    assert fed.inherited == "upon" and not branch.inheriting
    assert branch.content == "Once upon a time"


def test_the_snapshot_saved_while_streaming_is_marked_interrupted():
    reply = Reply()
    reply.start(Handle("r1"), index=1)
    reply.feed([Update("r1", "so far", tokens=2)])
    saved = reply.snapshot(ChatMessage("assistant", "so far", id="m1"))
    assert (saved.id, saved.content, saved.stats.finish_reason, saved.stats.generated_tokens) == \
        ("m1", "so far", FinishReason.INTERRUPTED, 2)


def test_the_rate_is_the_one_the_app_took_the_tokens_in_at_not_the_engines():
    clock = iter([10.0, 10.5, 12.0])
    reply = Reply(clock=lambda: next(clock))
    reply.start(Handle("r1"), index=1)
    reply.feed([Update("r1", "a", tokens=5)])                   # at 10.0: the rate counts from these on
    reply.feed([Update("r1", "", tokens=0, notices=("x",))])    # no tokens: no time taken
    reply.feed([Update("r1", "b", tokens=10)])                  # at 10.5
    assert reply.stats(FinishReason.CANCELLED).decode_tokens_per_s == 10 / 0.5
    final = Outcome("r1", text="abc", finish_reason="stop", generated_tokens=35, decode_tokens_per_s=500.0)
    ending = reply.finish(reply.feed([Update("r1", "c", tokens=20, outcome=final)]).outcome)   # at 12.0
    assert ending.stats.decode_tokens_per_s == 30 / 2.0


def test_a_reply_taken_in_one_batch_keeps_the_engines_rate():
    reply = Reply(clock=lambda: 1.0)
    reply.start(Handle("r1"), index=1)
    final = Outcome("r1", text="hi", finish_reason="stop", generated_tokens=2, decode_tokens_per_s=80.0)
    ending = reply.finish(reply.feed([Update("r1", "hi", tokens=2, outcome=final)]).outcome)
    assert ending.stats.decode_tokens_per_s == 80.0
