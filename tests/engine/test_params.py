"""The one declaration of the sampling fields: SamplingParams and a chat's SamplingSettings are checked by it."""

import dataclasses

import pytest

from pagedchat.engine.params import (CHAT_FIELDS, SAMPLING_FIELDS, SEED_RANGE, SamplingParams, SamplingSettings,
                                     sibling_seed)
from pagedchat.errors import RequestError


def past_and_inside(f):
    """(a value just past each bound, the nearest value inside it)."""
    step = 1 if f.kind is int else 0.5
    if f.low is not None:
        yield (f.low, f.low + step) if f.low_open else (f.low - step, f.low)
    if f.high is not None:
        yield (f.high, f.high - step) if f.high_open else (f.high + step, f.high)


@pytest.mark.parametrize("f", SAMPLING_FIELDS, ids=[f.name for f in SAMPLING_FIELDS])
def test_params_and_settings_follow_each_declared_field(f):
    assert getattr(SamplingParams(), f.name) == f.default
    made = [SamplingParams] + ([SamplingSettings] if f.chat else [])
    for past, inside in past_and_inside(f):
        for cls in made:
            with pytest.raises(RequestError, match=f"^{f.name} must be"):
                cls(**{f.name: past})
            assert getattr(cls(**{f.name: inside}), f.name) == inside
    with pytest.raises(RequestError, match=f"^{f.name} must be"):
        SamplingParams(**{f.name: True})   # a bool is not a number here
    with pytest.raises(ValueError, match=f"^{f.name} must be"):
        f.parse("many")
    if f.nullable:
        assert f.parse("") is None   # an empty field: unset
    else:
        with pytest.raises(ValueError, match=f"^{f.name} must be"):
            f.parse("")


def test_a_chat_keeps_the_chat_fields_with_their_chat_defaults():
    assert [x.name for x in dataclasses.fields(SamplingSettings)] == [f.name for f in CHAT_FIELDS]
    assert SamplingSettings() == SamplingSettings(**{f.name: f.for_chat for f in CHAT_FIELDS})
    assert SamplingSettings(presence_penalty=0.5, min_tokens=3).params(max_tokens=9) == \
        SamplingParams(max_tokens=9, temperature=0.7, top_p=0.95, presence_penalty=0.5, min_tokens=3)


def test_sibling_seeds_follow_the_seed_and_wrap_at_the_top_of_the_range():
    assert [sibling_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert [sibling_seed(-1, i) for i in range(3)] == [-1, 0, 1]
    top = SEED_RANGE.stop - 1
    assert [sibling_seed(top - 1, i) for i in range(4)] == [top - 1, top, 0, 1]
    assert all(sibling_seed(s, i) in SEED_RANGE for s in (SEED_RANGE.start, top) for i in range(16))
