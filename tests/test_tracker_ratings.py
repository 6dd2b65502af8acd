"""The tracker's own judgement of nodes, rule by rule: measured speeds (``.ratings``) and failure reports
(``.failure_reports``). Pure: times are passed in."""

from __future__ import annotations

import pytest

from services.tracker.failure_reports import REPORTS_PER_MINUTE, TRACKER, FailureGate, TooManyReports
from services.tracker.planner import Candidate, plan_route
from services.tracker.ratings import MAX_CLAIMED_TOKENS_PER_S, Ratings

LAYERS = 4


def whole(node_id: str, claim: float = 0.0) -> Candidate:
    return Candidate(node_id=node_id, endpoint=f"http://{node_id}:1", shard_start=0, shard_end=LAYERS - 1,
                     decode_tokens_per_s=claim)


def head_of(ratings: Ratings, *candidates: Candidate) -> str:
    return plan_route(ratings.rated(candidates), LAYERS)[0].node_id


def test_a_claim_is_clamped_and_only_seeds_a_node_until_it_is_measured() -> None:
    ratings = Ratings()
    liar, honest = whole("liar", 1e300), whole("honest", 200.0)
    assert ratings.rated([liar])[0].decode_tokens_per_s == MAX_CLAIMED_TOKENS_PER_S
    assert head_of(ratings, liar, honest) == "liar"
    ratings.observe(["liar"], LAYERS, ttft_s=1.0, total_s=3.0, tokens=3)  # 1 s a token, whatever it claims
    assert head_of(ratings, liar, honest) == "honest"
    ratings.observe(["honest"], LAYERS, ttft_s=0.05, total_s=0.3, tokens=3)
    assert head_of(ratings, liar, honest) == "honest"
    assert ratings.rating("liar", LAYERS).measured_tokens_per_s == pytest.approx(1.0)
    assert ratings.rating("honest", LAYERS).measured_streams == 1


def test_every_node_of_a_route_is_charged_alike_and_a_fast_route_wins_them_back() -> None:
    ratings = Ratings()
    ratings.observe(["a", "b"], LAYERS, ttft_s=0.1, total_s=4.0, tokens=4)
    assert ratings.rating("a", 2) == ratings.rating("b", 2)
    for _ in range(10):
        ratings.observe(["a"], LAYERS, ttft_s=0.1, total_s=0.4, tokens=4)
    assert ratings.rating("a", 2).measured_tokens_per_s > 5 * ratings.rating("b", 2).measured_tokens_per_s


def test_a_stream_without_tokens_measures_nothing() -> None:
    ratings = Ratings()
    ratings.observe(["a"], LAYERS, ttft_s=0.1, total_s=1.0, tokens=0)
    assert ratings.rating("a", LAYERS).measured_tokens_per_s is None


def test_one_reporter_alone_backs_a_node_off_once_in_the_window() -> None:
    gate = FailureGate(window_s=120.0)
    assert gate.judge("victim", "head-1", 0.0) == "apply"
    assert gate.judge("victim", "head-1", 10.0) == "noted"
    assert gate.judge("victim", "head-1", 100.0) == "noted"
    assert gate.judge("victim", "head-1", 130.0) == "apply"  # a new window


def test_a_second_reporter_or_the_tracker_itself_corroborates() -> None:
    gate = FailureGate(window_s=120.0)
    assert gate.judge("victim", "head-1", 0.0) == "apply"
    assert gate.judge("victim", "head-2", 1.0) == "apply"
    assert gate.judge("victim", "head-1", 2.0) == "apply"
    assert gate.judge("other", TRACKER, 0.0) == "apply"
    assert gate.judge("other", TRACKER, 1.0) == "apply"


def test_a_reporter_is_held_to_its_rate() -> None:
    gate = FailureGate(window_s=120.0)
    for index in range(REPORTS_PER_MINUTE):
        gate.count("head-1", float(index))
    with pytest.raises(TooManyReports) as refused:
        gate.count("head-1", 30.0)
    assert refused.value.retry_after_s == pytest.approx(30.0)
    gate.count("head-2", 30.0)  # another reporter has its own
    gate.count("head-1", 60.5)  # the oldest left the window
