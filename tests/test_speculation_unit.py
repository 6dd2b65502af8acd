"""Speculation's parts alone: the drafter, the acceptance rule of the tail's sampler, ``auto``'s choice of k.

The acceptance rule is checked statistically: over many seeds, the first
emitted token of a verified run is distributed as the target distribution of
its position, and, given a first token equal to the draft, the second as its
own; with a tolerance of 0.03 in each probability (the standard error at
6,000 draws is under 0.007).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from meshwire.sampling_params import SamplingParams
from services.node.head.drafter import propose
from services.node.head.speculation import MAX_BUSY_REQUESTS, MIN_NETWORK_MS, PROBE_EVERY, Speculation
from services.node.sampling.sampler import Sampler

DRAWS = 6_000
TOLERANCE = 0.03


def test_the_drafter_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 5, 6, 7]
    assert propose(tokens, 2) == (3, 4)  # "5 6 7" last occurred before "3 4"
    assert propose(tokens, 10) == (3, 4, 5, 6, 7)
    assert propose([1, 2, 3, 4], 3) == ()  # nothing repeats
    assert propose([7, 1, 2, 3, 1], 2) == (2, 3)  # a lone token is the last resort
    assert propose(tokens, 0) == ()


def _params(**fields: object) -> SamplingParams:
    return SamplingParams.model_validate({"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0, **fields})


def test_greedy_verification_keeps_the_longest_matching_prefix_plus_one() -> None:
    rows = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 0.0, 9.0], [3.0, 0.0, 0.0]])
    sampler = Sampler(_params(temperature=0.0))
    assert [p.token for p in sampler.verify(rows, (1, 0, 2))] == [1, 0, 2, 0]  # all accepted, then one more
    assert [p.token for p in sampler.verify(rows, (1, 2, 2))] == [1, 0]        # the second draft was wrong
    assert [p.token for p in sampler.verify(rows, (0, 0, 2))] == [1]
    with pytest.raises(ValueError):
        sampler.verify(rows, (1,))


def _frequencies(tokens: list[int], vocab: int) -> list[float]:
    counts = Counter(tokens)
    return [counts[token] / max(len(tokens), 1) for token in range(vocab)]


@pytest.mark.parametrize("draft", [(1, 2), (3, 0), (0, 4)])
def test_speculative_sampling_emits_tokens_distributed_as_the_target(draft: tuple[int, int]) -> None:
    rows = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0], [0.0, -1.0, 1.5, 0.5, 1.0], [2.0, 0.0, 0.0, 0.0, -2.0]])
    params = _params(temperature=0.9, top_k=4)
    sampler = Sampler(params)
    target = [torch.softmax(Sampler(params)._warpers(torch.empty((1, 0), dtype=torch.long), row.unsqueeze(0))[0], -1)
              for row in rows]
    firsts: list[int] = []
    seconds: list[int] = []
    for seed in range(DRAWS):
        sampler._generator.manual_seed(seed)
        run = [p.token for p in sampler.verify(rows, draft)]
        assert 1 <= len(run) <= 3
        assert run[:-1] == list(draft[:len(run) - 1])  # accepted drafts, then one token of its own
        firsts.append(run[0])
        if run[0] == draft[0]:
            seconds.append(run[1])
    for got, want in zip(_frequencies(firsts, 5), target[0].tolist(), strict=True):
        assert abs(got - want) <= TOLERANCE
    if target[0][draft[0]] > 0:  # (1, 2) and (0, 4): the first draft is accepted often enough to judge the second
        assert len(seconds) > DRAWS // 10
        for got, want in zip(_frequencies(seconds, 5), target[1].tolist(), strict=True):
            assert abs(got - want) <= TOLERANCE * 2
    else:  # (3, 0): top-k leaves token 3 no probability, so its draft is never accepted
        assert not seconds


def test_auto_does_not_draft_on_a_fast_link_and_drafts_on_a_slow_one() -> None:
    copy = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    fast = Speculation("auto", 4)
    for _ in range(5):
        fast.observe(0, 1, wall_ms=20.0 + MIN_NETWORK_MS / 2, compute_ms=20.0)
    assert asyncio.run(fast.draft(copy, 100)) == ()
    slow = Speculation("auto", 4)
    for _ in range(5):
        slow.observe(0, 1, wall_ms=120.0, compute_ms=20.0)
    drafted = asyncio.run(slow.draft(copy, 100))
    assert drafted and drafted == (4, 5, 6, 1)[:len(drafted)]
    for _ in range(10):  # every draft rejected: drafting stops paying
        slow.observe(4, 1, wall_ms=130.0, compute_ms=30.0)
    assert slow.choose_k(4) == 0
    for _ in range(PROBE_EVERY):
        slow.observe(0, 1, wall_ms=120.0, compute_ms=20.0)
    assert slow.choose_k(4) > 0  # it tries again now and then


def test_auto_stands_down_while_the_head_batches_many_requests_and_on_does_not() -> None:
    """Many requests on one head: their steps wait for each other's turns, which reads as network time; auto
    must not draft then (a speculative step would run alone and break the batch). ``on`` still drafts."""
    copy = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    generating = [MAX_BUSY_REQUESTS + 1]
    auto = Speculation("auto", 4, busy=lambda: generating[0])
    on = Speculation("on", 4, busy=lambda: generating[0])
    for _ in range(5):
        auto.observe(0, 1, wall_ms=120.0, compute_ms=20.0)
    assert asyncio.run(auto.draft(copy, 100)) == ()
    assert asyncio.run(on.draft(copy, 100)) != ()
    generating[0] = MAX_BUSY_REQUESTS
    assert asyncio.run(auto.draft(copy, 100)) != ()


def test_drafts_never_run_past_max_tokens_and_off_never_drafts() -> None:
    copy = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert asyncio.run(Speculation("on", 4).draft(copy, 3)) == (4, 5)  # 3 to go: 2 drafts and the tail's own
    assert asyncio.run(Speculation("on", 4).draft(copy, 1)) == ()
    assert asyncio.run(Speculation("off", 4).draft(copy, 100)) == ()
    with pytest.raises(ValueError):
        Speculation("on", 0)


def test_auto_estimates_acceptance_per_judged_draft_so_a_good_drafter_gets_a_larger_k() -> None:
    """Four drafts of which three are accepted judged four (the fourth rejected): 0.75, not 3/4 of a run."""
    spec = Speculation("auto", 8)
    for _ in range(5):
        spec.observe(0, 1, wall_ms=120.0, compute_ms=20.0)
    for _ in range(20):  # every draft of 4 accepted: the estimate climbs towards 1
        spec.observe(4, 5, wall_ms=125.0, compute_ms=25.0)
    assert spec.acceptance > 0.9
    assert spec.choose_k(8) == 8
    for _ in range(40):  # the first two of four accepted, the third rejected (the fourth never judged): 2/3
        spec.observe(4, 3, wall_ms=125.0, compute_ms=25.0)
    assert spec.acceptance == pytest.approx(2 / 3, abs=0.02)


def test_a_route_that_cannot_verify_drafts_stops_them() -> None:
    spec = Speculation("on", 4)
    spec.stop()
    assert asyncio.run(spec.draft([1, 2, 3, 1, 2], 100)) == ()
