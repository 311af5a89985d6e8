"""The n-gram drafter: what it proposes, and that its index follows appended tokens."""

import random
import time

from pagedchat.engine.ngram import NgramIndex, Speculation
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.sequence import Sequence


def brute_force(tokens, n_min, n_max, k):
    """The reference: for n from n_max down, the latest earlier occurrence of the last n tokens."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - 1, n - 1, -1):
            if tokens[start - n:start] == suffix:
                return tokens[start:start + k]
    return []


def test_proposes_what_followed_the_longest_match():
    index = NgramIndex(n_min=2, n_max=4)
    # "5 6 7" occurred before, followed by 8 9 10; "6 7" alone later, followed by 99.
    tokens = [1, 5, 6, 7, 8, 9, 10, 11, 6, 7, 99, 3, 5, 6, 7]
    assert index.propose(tokens, 3) == [8, 9, 10]
    assert index.propose(tokens, 0) == []


def test_no_match_no_draft_and_the_suffix_never_matches_itself():
    index = NgramIndex()
    assert index.propose([1, 2, 3, 4], 8) == []
    assert index.propose([7], 8) == []
    assert index.propose([], 8) == []


def test_the_draft_stops_at_the_end_of_the_text():
    assert NgramIndex(n_min=2, n_max=2).propose([4, 4, 4], 8) == [4]  # "4 4" ended at 2, then one token
    assert NgramIndex(n_min=2, n_max=2).propose([1, 2, 3, 1, 2], 8) == [3, 1, 2]


def test_the_index_follows_appends_as_a_fresh_search_would():
    rng = random.Random(0)
    index = NgramIndex(n_min=2, n_max=4)
    tokens: list[int] = []
    for _ in range(600):
        tokens.extend(rng.choice([1, 2, 3, 4, 5]) for _ in range(rng.choice([1, 1, 3])))
        assert index.propose(tokens, 5) == brute_force(tokens, 2, 4, 5)


def test_a_lookup_without_a_match_costs_the_same_on_a_long_text():
    index = NgramIndex()
    tokens = list(range(50_000))  # no n-gram repeats
    index.propose(tokens, 8)      # indexes once
    start = time.perf_counter()
    for i in range(1000):
        tokens.append(100_000 + i)
        assert index.propose(tokens, 8) == []
    assert time.perf_counter() - start < 0.5  # a few dict probes a step, not a scan of 50k tokens


def test_the_match_counts_the_tokens_that_agree_before_it_up_to_the_longest_asked():
    index = NgramIndex(n_min=2, n_max=4)
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 50, 51, 8, 1, 2, 3, 4, 5, 6]  # "1 .. 6" again: six agree, "7" followed
    found = index.match(tokens, 16)
    assert (found.start, found.length) == (7, 6)
    assert index.match(tokens, 5).length == 5
    assert NgramIndex().match([1, 2, 3, 1, 2], 16).length == 2  # the earlier "1 2" starts the text


def test_a_draft_is_no_longer_than_its_match():
    spec = Speculation("ngram", k=16)
    short = Sequence("a", [7, 1, 2, 3, 4, 5, 6, 8, 1, 2], 10, SamplingParams())  # "1 2" again: two agree
    long = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5], 14, SamplingParams())
    assert spec.draft(short, 16) == [3, 4]
    assert spec.draft(long, 16) == [6, 7, 8, 9, 1]  # five agree; the text runs out after five
    assert spec.draft(long, 3) == [6, 7, 8]
