"""The rules of ``PUT /route`` and ``GET /route`` (``reference/bootstrap-spec.md``), on the table itself."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.bootstrap.integers import div_euclid, rem_euclid
from services.bootstrap.refusals import Refusal
from services.bootstrap.registry import MAX_RANK_IP_BYTES, BootstrapRegistry, RegistryKind
from tests.bootstrap_samples import registration

SIZES = {"engine_rank": "-1", "target_dp_group": "-1"}


def table(kind: RegistryKind = "addresses", **options: Any) -> BootstrapRegistry:
    return BootstrapRegistry(kind, **options)


def register(registry: BootstrapRegistry, body: Any) -> None:
    registry.register(body if isinstance(body, bytes) else orjson.dumps(body))


def refusal_of(registry: BootstrapRegistry, body: Any) -> tuple[int, str]:
    with pytest.raises(Refusal) as refused:
        register(registry, body)
    return refused.value.status, refused.value.message


def lookup(registry: BootstrapRegistry, engine_rank: int, dp_group: int) -> dict[str, Any]:
    return registry.route({"engine_rank": str(engine_rank), "target_dp_group": str(dp_group)})


def lookup_refusal(registry: BootstrapRegistry, query: dict[str, str]) -> tuple[int, str]:
    with pytest.raises(Refusal) as refused:
        registry.route(query)
    return refused.value.status, refused.value.message


# --- rule 1: a JSON object with six keys ------------------------------------------------------

@pytest.mark.parametrize("body", [b"", b"{", b"not json", b"{'role': 1}", b"\xff\xfe"])
def test_a_body_that_is_not_json_is_refused(body: bytes) -> None:
    assert refusal_of(table(), body) == (500, "the registration is not JSON")


@pytest.mark.parametrize("body", [[], "Prefill", 4, None])
def test_json_that_is_not_an_object_lacks_the_first_key(body: Any) -> None:
    assert refusal_of(table(), body) == (500, "missing role")


@pytest.mark.parametrize("key", ["role", "world_size", "dp_size", "rank_ip", "rank_port", "engine_rank"])
def test_each_required_key_missing_is_named(key: str) -> None:
    body = registration(0)
    del body[key]
    assert refusal_of(table(), body) == (500, f"missing {key}")


def test_missing_keys_are_reported_in_the_reference_order() -> None:
    assert refusal_of(table(), {"rank_port": 1, "engine_rank": 0}) == (500, "missing role")
    assert refusal_of(table(), {"role": "Prefill", "rank_ip": "h"}) == (500, "missing world_size")


# --- rule 2: integers and rank_ip --------------------------------------------------------------

@pytest.mark.parametrize("sent", [7003, "7003", "  7003 ", "+7003", "\t7003\n"])
def test_rank_port_is_an_integer_or_a_string_of_one(sent: Any) -> None:
    registry = table()
    register(registry, registration(3, port=sent))
    assert lookup(registry, 1, 1) == {"rank_ip": "10.0.0.1", "rank_port": 7003}


@pytest.mark.parametrize("name", ["rank_port", "engine_rank"])
@pytest.mark.parametrize("sent", [7.5, 7.0, True, None, "7k", "", " ", "1_000", "٣", [7], {"v": 7}, 1 << 63])
def test_a_value_that_is_not_an_integer_is_refused(name: str, sent: Any) -> None:
    body = registration(0)
    body[name] = sent
    assert refusal_of(table(), body) == (500, f"{name} is not an integer")


def test_engine_rank_as_a_string_places_the_rank() -> None:
    registry = table()
    register(registry, registration(" 3 ", port=7003))
    assert lookup(registry, 1, 1)["rank_port"] == 7003


@pytest.mark.parametrize("rank_ip", ["10.0.0.1", "prefill-0.cluster.local", "::1", ["10.0.0.1", 7], None])
def test_rank_ip_is_stored_and_served_as_sent(rank_ip: Any) -> None:
    registry = table()
    register(registry, registration(0, rank_ip=rank_ip))
    assert lookup(registry, 0, 0)["rank_ip"] == rank_ip


def test_an_oversized_rank_ip_is_refused_and_not_recorded() -> None:
    registry = table()
    status, message = refusal_of(registry, registration(0, rank_ip="h" * MAX_RANK_IP_BYTES))
    assert (status, message) == (400, f"rank_ip is longer than {MAX_RANK_IP_BYTES} bytes")
    assert registry.registered_ranks == 0


# --- rule 4: first-wins sizes, last-wins pp_size -------------------------------------------------

def test_world_and_dp_sizes_are_first_wins() -> None:
    registry = table()
    register(registry, registration(0))
    register(registry, registration(1, world_size=8, dp_size=4))
    assert registry.route(SIZES)["prefill_tp_size"] == 4
    assert registry.route(SIZES)["prefill_dp_size"] == 2


def test_sizes_are_served_as_the_first_registration_sent_them() -> None:
    registry = table()
    register(registry, registration(0, world_size="4", dp_size=" 2"))
    sizes = registry.route(SIZES)
    assert (sizes["prefill_tp_size"], sizes["prefill_dp_size"]) == ("4", " 2")


def test_pp_size_is_last_wins() -> None:
    registry = table()
    register(registry, registration(0, pp_size=2))
    register(registry, registration(1, pp_size="3"))
    assert registry.route(SIZES)["prefill_pp_size"] == 3
    register(registry, registration(2))
    assert registry.route(SIZES)["prefill_pp_size"] == 3


def test_a_pp_size_that_is_not_an_integer_is_refused() -> None:
    assert refusal_of(table(), registration(0, pp_size="two")) == (500, "pp_size is not an integer")


# --- rule 5: tp from this request's sizes ----------------------------------------------------------

def test_dp_size_zero_is_refused() -> None:
    assert refusal_of(table(), registration(0, dp_size=0)) == (500, "dp_size must not be zero")


@pytest.mark.parametrize("name", ["world_size", "dp_size"])
def test_sizes_that_are_not_integers_are_refused(name: str) -> None:
    assert refusal_of(table(), registration(0, **{name: "many"})) == (500, f"{name} is not an integer")


def test_a_later_rank_is_placed_with_its_own_sizes_not_the_first() -> None:
    registry = table()
    register(registry, registration(0))  # world 4, DP 2: TP 2
    register(registry, registration(3, port=9003, world_size=8, dp_size=2))  # its TP is 4
    assert lookup(registry, 3, 0)["rank_port"] == 9003


# --- rule 6: only Prefill is recorded; the DP/TP mapping ----------------------------------------

def test_a_rank_of_another_role_sets_the_sizes_but_is_not_recorded() -> None:
    registry = table()
    register(registry, registration(0, role="Decode"))
    assert registry.route(SIZES)["prefill_tp_size"] == 4
    assert registry.registered_ranks == 0
    assert lookup_refusal(registry, {"engine_rank": "0", "target_dp_group": "0"}) == (
        500, "Bootstrap info not Found")


def test_a_prefill_with_world_below_dp_is_refused_but_another_role_is_not() -> None:
    assert refusal_of(table(), registration(0, world_size=1, dp_size=2)) == (
        500, "world_size must not be below dp_size")
    register(table(), registration(0, role="Decode", world_size=1, dp_size=2))


def test_ranks_are_recorded_under_dp_group_and_tp_rank() -> None:
    registry = table()
    for rank in range(8):
        register(registry, registration(rank, port=7000 + rank, world_size=8, dp_size=2))
    for rank in range(8):
        assert lookup(registry, rank % 4, rank // 4)["rank_port"] == 7000 + rank
    assert registry.registered_ranks == 8


def test_registering_a_slot_again_replaces_it() -> None:
    registry = table()
    register(registry, registration(3, port=7003))
    register(registry, registration(3, port=8003, rank_ip="10.0.0.2"))
    assert lookup(registry, 1, 1) == {"rank_ip": "10.0.0.2", "rank_port": 8003}
    assert registry.registered_ranks == 1


def test_with_pipeline_parallelism_the_rank_is_the_dense_stage_major_rank() -> None:
    registry = table()
    tp = 2
    for pp_rank in range(2):
        for tp_rank in range(tp):
            dense = pp_rank * tp + tp_rank
            register(registry, registration(dense, port=7000 + 10 * pp_rank + tp_rank,
                                            world_size=4, dp_size=1, pp_size=2))
    assert lookup(registry, 1 * tp + 1, 0)["rank_port"] == 7011
    assert registry.route(SIZES)["prefill_pp_size"] == 2


@pytest.mark.parametrize(("value", "divisor"), [(7, 2), (-7, 2), (7, -2), (-7, -2), (6, -3), (0, 5)])
def test_division_is_the_references_euclidean_one(value: int, divisor: int) -> None:
    quotient, remainder = div_euclid(value, divisor), rem_euclid(value, divisor)
    assert quotient * divisor + remainder == value
    assert 0 <= remainder < abs(divisor)


# --- refusals record nothing; the table is bounded ---------------------------------------------

def test_a_refused_registration_records_nothing() -> None:
    registry = table()
    refusal_of(registry, registration(0, world_size=8, dp_size=0, pp_size=5))
    refusal_of(registry, registration(0, world_size="eight"))
    assert registry.route(SIZES) == {"prefill_tp_size": None, "prefill_dp_size": None, "prefill_pp_size": 1}
    assert registry.registered_ranks == 0


def test_a_full_table_refuses_new_slots_but_still_replaces_known_ones() -> None:
    registry = table(max_ranks=2)
    register(registry, registration(0))
    register(registry, registration(1))
    assert refusal_of(registry, registration(2)) == (507, "the bootstrap table is full (2 ranks)")
    register(registry, registration(1, port=9001))
    assert lookup(registry, 1, 0)["rank_port"] == 9001


# --- GET /route ------------------------------------------------------------------------------------

def test_sizes_before_any_registration_are_null() -> None:
    assert table().route(SIZES) == {"prefill_tp_size": None, "prefill_dp_size": None, "prefill_pp_size": 1}


def test_a_cache_layouts_table_adds_layout_and_placement_to_the_sizes() -> None:
    assert table("cache-layouts").route(SIZES) == {
        "prefill_tp_size": None, "prefill_dp_size": None, "prefill_pp_size": 1,
        "cache_layout": None, "cache_fields_by_stage": None,
    }


@pytest.mark.parametrize("query", [
    {}, {"engine_rank": "1"}, {"target_dp_group": "1"},
    {"engine_rank": "", "target_dp_group": "1"}, {"engine_rank": "1", "target_dp_group": ""},
])
def test_a_lookup_with_missing_or_empty_inputs_is_a_400(query: dict[str, str]) -> None:
    assert lookup_refusal(table(), query) == (400, "Missing inputs for bootstrap server.")


@pytest.mark.parametrize(("query", "name"), [
    ({"engine_rank": "one", "target_dp_group": "0"}, "engine_rank"),
    ({"engine_rank": "0", "target_dp_group": "0.5"}, "target_dp_group"),
    ({"engine_rank": " ", "target_dp_group": "0"}, "engine_rank"),
])
def test_a_lookup_input_that_is_not_an_integer_is_a_500(query: dict[str, str], name: str) -> None:
    assert lookup_refusal(table(), query) == (500, f"{name} is not an integer")


@pytest.mark.parametrize("query", [(-1, 0), (0, -1), (0, 0), (5, 5)])
def test_an_unregistered_pair_is_not_found(query: tuple[int, int]) -> None:
    registry = table()
    register(registry, registration(3))
    engine_rank, dp_group = query
    assert lookup_refusal(registry, {"engine_rank": str(engine_rank), "target_dp_group": str(dp_group)}) == (
        500, "Bootstrap info not Found")


def test_lookup_inputs_may_carry_spaces_and_signs() -> None:
    registry = table()
    register(registry, registration(3, port=7003))
    assert registry.route({"engine_rank": " +1", "target_dp_group": "1 "})["rank_port"] == 7003
