"""The tracker registry: leases, states, expiry, failure backoff, coverage (time driven by hand)."""

from __future__ import annotations

import itertools

import pytest

from meshwire.registry import NodeRegistration
from services.tracker.planner import plan_route
from services.tracker.registry import (
    LeaseConflict,
    LeaseRequired,
    Registry,
    RegistryFull,
    RegistryPolicy,
    UnknownNode,
    resolve_model_name,
)

POLICY = RegistryPolicy(ttl_s=6.0, suspect_s=3.0, offline_keep_s=300.0, max_nodes=8,
                        backoff_s=5.0, backoff_max_s=20.0, failure_reset_s=120.0)
MODEL = "/models/tiny"


def reg(node_id: str = "a", start: int = 0, end: int = 3, *, port: int = 9001, model: str = MODEL,
        num_layers: int | None = 4, **load: object) -> NodeRegistration:
    return NodeRegistration(node_id=node_id, model=model, endpoint=f"http://127.0.0.1:{port}",
                            shard_start=start, shard_end=end, num_layers=num_layers, **load)  # type: ignore[arg-type]


@pytest.fixture
def registry() -> Registry:
    counter = itertools.count()
    return Registry(POLICY, new_lease=lambda: f"lease-{next(counter)}")


def routable_ids(registry: Registry, now: float, model: str = MODEL) -> set[str]:
    return {c.node_id for c in registry.candidates(model, now)}


# --- leases -------------------------------------------------------------------------------------------


def test_a_first_registration_gets_a_lease_and_heartbeats_keep_it(registry: Registry) -> None:
    first = registry.register(reg("a"), None, now=0.0)
    again = registry.register(reg("a"), first.lease, now=2.0)
    assert first.new_lease and not again.new_lease and again.lease == first.lease
    assert registry.state("a", 2.0) == "online"


def test_a_node_cannot_register_under_a_live_nodes_id(registry: Registry) -> None:
    registry.register(reg("a", port=9001), None, now=0.0)
    with pytest.raises(LeaseConflict):
        registry.register(reg("a", port=9002), None, now=1.0)
    with pytest.raises(LeaseConflict):
        registry.register(reg("a", port=9002), "guessed-lease", now=1.0)
    assert registry.snapshot(1.0)[0].endpoint == "http://127.0.0.1:9001"


def test_a_live_id_cannot_be_taken_over_at_its_own_public_endpoint_without_the_lease(registry: Registry) -> None:
    old = registry.register(reg("a"), None, now=0.0)
    with pytest.raises(LeaseConflict, match="X-Meshnet-Lease"):
        registry.register(reg("a"), None, now=2.0)
    assert registry.register(reg("a"), old.lease, now=3.0).lease == old.lease


def test_a_node_restarted_without_its_lease_gets_its_id_back_once_the_old_entry_expires(
        registry: Registry) -> None:
    old = registry.register(reg("a"), None, now=0.0)
    registry.report_failure("a", "connection refused", now=1.0)
    restarted = registry.register(reg("a"), None, now=6.5)
    assert restarted.new_lease and restarted.lease != old.lease
    assert registry.state("a", 6.5) == "joining"  # a clean slate: no backoff carried over
    with pytest.raises(LeaseConflict):
        registry.register(reg("a"), old.lease, now=7.0)  # the old lease is worth nothing now


def test_an_offline_id_can_be_taken_by_a_new_node(registry: Registry) -> None:
    registry.register(reg("a", port=9001), None, now=0.0)
    taken = registry.register(reg("a", port=9002), None, now=10.0)
    assert taken.new_lease
    assert registry.snapshot(10.0)[0].endpoint == "http://127.0.0.1:9002"


def test_a_heartbeat_after_a_silence_brings_the_node_back_with_its_lease(registry: Registry) -> None:
    first = registry.register(reg("a"), None, now=0.0)
    assert registry.state("a", 7.0) == "offline"
    back = registry.register(reg("a"), first.lease, now=8.0)
    assert back.lease == first.lease and registry.state("a", 8.0) == "online"


def test_a_heartbeat_with_a_lease_the_tracker_never_issued_registers_afresh(registry: Registry) -> None:
    answer = registry.register(reg("a"), "lease-from-a-previous-tracker", now=0.0)
    assert answer.new_lease and answer.lease != "lease-from-a-previous-tracker"


def test_a_node_disagreeing_with_its_models_layer_count_is_listed_but_not_routed(registry: Registry) -> None:
    registry.register(reg("a", 0, 1, num_layers=4), None, now=0.0)
    registry.register(reg("c", 2, 3, port=9003, num_layers=4), None, now=0.5)
    registry.register(reg("b", 2, 5, port=9002, num_layers=6), None, now=1.0)
    assert registry.models(1.0) == {MODEL: 4}
    assert routable_ids(registry, 1.0) == {"a", "c"}
    listed = {n.node_id: n for n in registry.snapshot(1.0)}
    assert not listed["b"].routable and not listed["b"].num_layers_agreed and listed["b"].state == "joining"
    assert listed["a"].routable and listed["a"].num_layers_agreed


def test_a_lying_first_registration_does_not_fix_the_layer_count_and_is_forgotten_with_its_lease(
        registry: Registry) -> None:
    registry.register(reg("liar", 0, 1, port=9009, num_layers=2), None, now=0.0)
    assert registry.models(0.0) == {MODEL: 2}
    honest = {"a": registry.register(reg("a", 0, 1, port=9001), None, now=1.0).lease,
              "b": registry.register(reg("b", 2, 3, port=9002), None, now=1.0).lease}
    assert registry.models(1.0) == {MODEL: 4}
    assert routable_ids(registry, 1.0) == {"a", "b"}
    assert [hop.node_id for hop in plan_route(registry.candidates(MODEL, 1.0), 4)] == ["a", "b"]
    registry.register(reg("a", 0, 1, port=9001), honest["a"], now=5.0)  # the liar has fallen silent
    registry.deregister("b", honest["b"], now=5.5)
    assert registry.models(5.5) == {MODEL: 2}  # one against one, and both ranges fit 2: the older lease wins
    assert registry.state("liar", 6.5) == "offline"
    assert registry.models(6.5) == {MODEL: 4}  # its lease expired: its count is forgotten
    assert routable_ids(registry, 6.5) == {"a"}


def test_a_tie_on_the_layer_count_goes_to_the_count_every_nodes_layers_fit_in(registry: Registry) -> None:
    registry.register(reg("liar", 0, 1, port=9009, num_layers=2), None, now=0.0)
    registry.register(reg("a", 0, 3, port=9001), None, now=1.0)  # holds layer 3: a count of 2 cannot be
    assert registry.models(1.0) == {MODEL: 4}
    assert routable_ids(registry, 1.0) == {"a"}


def test_a_tie_the_layer_ranges_cannot_settle_goes_to_the_longest_held_lease(registry: Registry) -> None:
    registry.register(reg("first", 0, 1, port=9001, num_layers=6), None, now=0.0)
    registry.register(reg("second", 0, 1, port=9002, num_layers=4), None, now=1.0)
    assert registry.models(1.0) == {MODEL: 6}
    assert routable_ids(registry, 1.0) == {"first"}


def test_the_registry_refuses_nodes_beyond_its_bound_but_evicts_offline_ones_first() -> None:
    registry = Registry(RegistryPolicy(ttl_s=6.0, max_nodes=2))
    registry.register(reg("a", port=9001), None, now=0.0)
    registry.register(reg("b", port=9002), None, now=0.0)
    with pytest.raises(RegistryFull):
        registry.register(reg("c", port=9003), None, now=1.0)
    registry.register(reg("c", port=9003), None, now=10.0)  # a and b are offline by now
    assert {n.node_id for n in registry.snapshot(10.0)} >= {"c"} and len(registry) == 2


# --- states and expiry ---------------------------------------------------------------------------------


def test_a_node_goes_from_joining_to_online_to_suspect_to_offline(registry: Registry) -> None:
    lease = registry.register(reg("a"), None, now=0.0).lease
    assert registry.state("a", 0.5) == "joining"
    registry.register(reg("a"), lease, now=1.0)
    assert registry.state("a", 1.5) == "online"
    assert registry.state("a", 5.0) == "suspect"
    assert registry.state("a", 7.5) == "offline"


def test_a_silent_node_leaves_the_routes_after_the_ttl(registry: Registry) -> None:
    registry.register(reg("a"), None, now=0.0)
    assert routable_ids(registry, 5.9) == {"a"}
    assert routable_ids(registry, 6.1) == set()


def test_an_offline_node_stays_listed_for_a_while_then_is_forgotten(registry: Registry) -> None:
    registry.register(reg("a"), None, now=0.0)
    assert [n.state for n in registry.snapshot(100.0)] == ["offline"]
    assert registry.snapshot(6.0 + 300.0 + 1.0) == ()


def test_a_deregistered_node_is_offline_at_once(registry: Registry) -> None:
    lease = registry.register(reg("a"), None, now=0.0).lease
    registry.deregister("a", lease, now=1.0)
    assert registry.state("a", 1.0) == "offline" and routable_ids(registry, 1.0) == set()


def test_deregistering_needs_the_nodes_lease(registry: Registry) -> None:
    registry.register(reg("a"), None, now=0.0)
    with pytest.raises(LeaseRequired):
        registry.deregister("a", "not-the-lease", now=1.0)
    with pytest.raises(LeaseRequired):
        registry.deregister("a", None, now=1.0)
    with pytest.raises(UnknownNode):
        registry.deregister("nobody", "any", now=1.0)
    assert registry.state("a", 1.0) == "joining"


# --- failures and backoff ---------------------------------------------------------------------------------


def test_repeated_failures_back_off_longer_each_time_up_to_a_cap(registry: Registry) -> None:
    registry.register(reg("a"), None, now=0.0)
    backoffs = []
    now = 1.0
    for _ in range(4):
        backoffs.append(registry.report_failure("a", "timeout", now=now))
        now += backoffs[-1] + 0.1
    assert backoffs == [5.0, 10.0, 20.0, 20.0]


def test_reports_during_a_backoff_do_not_lengthen_it(registry: Registry) -> None:
    registry.register(reg("a"), None, now=0.0)
    assert registry.report_failure("a", "timeout", now=1.0) == 5.0
    assert registry.report_failure("a", "timeout", now=2.0) == pytest.approx(4.0)
    assert registry.report_failure("a", "timeout", now=6.5) == 10.0  # the next run, after the backoff


def test_a_failure_long_after_the_last_starts_the_backoff_over(registry: Registry) -> None:
    lease = registry.register(reg("a"), None, now=0.0).lease
    registry.report_failure("a", "timeout", now=1.0)
    registry.report_failure("a", "timeout", now=7.0)
    for t in range(10, 200, 2):
        registry.register(reg("a"), lease, now=float(t))
    assert registry.report_failure("a", "timeout", now=200.0) == 5.0


def test_a_node_in_backoff_is_suspect_and_avoided_then_comes_back_by_itself(registry: Registry) -> None:
    a = registry.register(reg("a", port=9001), None, now=0.0).lease
    b = registry.register(reg("b", port=9002), None, now=0.0).lease
    registry.report_failure("a", "connection refused", now=1.0)
    assert registry.state("a", 1.0) == "suspect"
    assert plan_route(registry.candidates(MODEL, 2.0), 4)[0].node_id == "b"
    for t in (2.0, 4.0, 6.0):
        registry.register(reg("a", port=9001), a, now=t)
        registry.register(reg("b", port=9002), b, now=t)
    assert registry.state("a", 6.5) == "online"
    assert not any(c.backoff for c in registry.candidates(MODEL, 6.5))


def test_the_only_holder_of_a_range_stays_routable_in_backoff(registry: Registry) -> None:
    registry.register(reg("a", 0, 1, port=9001), None, now=0.0)
    registry.register(reg("b", 2, 3, port=9002), None, now=0.0)
    registry.report_failure("b", "timeout", now=1.0)
    assert [h.node_id for h in plan_route(registry.candidates(MODEL, 1.0), 4)] == ["a", "b"]


def test_a_failure_report_about_an_unknown_node_is_refused(registry: Registry) -> None:
    with pytest.raises(UnknownNode):
        registry.report_failure("nobody", "timeout", now=0.0)


# --- load and views -----------------------------------------------------------------------------------


def test_in_flight_requests_count_as_load_until_the_node_reports_more(registry: Registry) -> None:
    registry.register(reg("a", active_sessions=1), None, now=0.0)
    registry.begin_request(["a"])
    registry.begin_request(["a"])
    assert registry.candidates(MODEL, 0.0)[0].active_sessions == 2
    registry.end_request(["a"])
    registry.end_request(["a"])
    registry.end_request(["a"])
    assert registry.candidates(MODEL, 0.0)[0].active_sessions == 1


def test_coverage_names_missing_layers_and_holders_per_layer(registry: Registry) -> None:
    registry.register(reg("a", 0, 1, port=9001), None, now=0.0)
    registry.register(reg("b", 0, 0, port=9002), None, now=0.0)
    (coverage,) = registry.coverage(1.0)
    assert coverage.model == MODEL and coverage.num_layers == 4
    assert not coverage.complete and coverage.missing == ((2, 3),)
    assert coverage.layer_holders == (2, 1, 0, 0)


def test_a_model_with_only_offline_nodes_is_listed_as_missing_every_layer(registry: Registry) -> None:
    registry.register(reg("a"), None, now=0.0)
    (coverage,) = registry.coverage(10.0)
    assert coverage.missing == ((0, 3),) and coverage.nodes_routable == 0 and coverage.nodes_listed == 1


def test_the_node_list_shows_load_and_health(registry: Registry) -> None:
    registry.register(reg("a", kv_capacity_tokens=100, kv_free_tokens=40, active_sessions=2,
                          decode_tokens_per_s=12.5), None, now=0.0)
    (info,) = registry.snapshot(1.5)
    assert (info.kv_free_tokens, info.kv_capacity_tokens, info.active_sessions) == (40, 100, 2)
    assert info.decode_tokens_per_s == 12.5 and info.last_heartbeat_age_s == 1.5
    assert info.state == "joining" and info.routable


def test_a_model_is_found_by_its_exact_name_or_its_unique_basename() -> None:
    known = ["/tmp/x/tiny", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert resolve_model_name("/tmp/x/tiny", known) == "/tmp/x/tiny"
    assert resolve_model_name("tiny", known) == "/tmp/x/tiny"
    assert resolve_model_name("SmolLM2-135M-Instruct", known) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model_name("gpt-4", known) is None
    assert resolve_model_name("tiny", ["/a/tiny", "/b/tiny"]) is None


def test_the_listing_shows_how_each_node_holds_its_weights_and_the_memory_they_take(registry: Registry) -> None:
    registry.register(reg("a", weights="int4", weight_bytes=68_600_000, kv_bytes=4096), None, now=0.0)
    registry.register(reg("b", port=9002), None, now=0.0)
    listed = {info.node_id: info for info in registry.snapshot(1.0)}
    assert (listed["a"].weights, listed["a"].weight_bytes, listed["a"].kv_bytes) == ("int4", 68_600_000, 4096)
    assert (listed["b"].weights, listed["b"].weight_bytes) == (None, 0)


def test_a_node_shows_the_rows_its_quantized_products_take_so_spot_checks_compare_only_alike_nodes(
        registry: Registry) -> None:
    registry.register(reg("a", weights="int4", activations="int8"), None, now=0.0)
    registry.register(reg("b", port=9002, weights="int4"), None, now=0.0)
    shown = {node.node_id: node.activations for node in registry.snapshot(0.0)}
    assert shown == {"a": "int8", "b": None}
    with pytest.raises(ValueError, match="activations"):
        reg("c", activations="int4")
