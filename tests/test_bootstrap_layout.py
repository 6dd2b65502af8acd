"""The cache layout contract and the stage placement rules of a ``cache-layouts`` registry."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from services.bootstrap.layout import MAX_LAYOUT_BYTES, CacheLayout, LayoutError
from services.bootstrap.refusals import Refusal
from services.bootstrap.registry import BootstrapRegistry
from tests.bootstrap_samples import cache_registration, layout, layout_dict, registration

SIZES = {"engine_rank": "-1", "target_dp_group": "-1"}
Mutation = Callable[[dict[str, Any]], None]


def wire_of(mutate: Mutation) -> str:
    data = copy.deepcopy(layout_dict())
    mutate(data)
    return json.dumps(data)


def is_valid(wire: str) -> bool:
    try:
        CacheLayout.from_wire(wire)
    except LayoutError:
        return False
    return True


def first_field(data: dict[str, Any]) -> dict[str, Any]:
    field: dict[str, Any] = data["plan"]["fields"][0]
    return field


# --- what a valid layout is ---------------------------------------------------------------------

def test_the_reference_layout_is_valid() -> None:
    parsed = CacheLayout.from_wire(layout())
    assert parsed.field_ids == {"layer.0.kv", "layer.1.kv"}


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(field_addresses={"layer.0.kv": 4096}),
    lambda d: d.update(vendor_extension=[1, 2, 3]),
    lambda d: d.pop("field_addresses"),
    lambda d: d["plan"].pop("resident_block_bytes"),
    lambda d: d["plan"].update(resident_block_bytes=4096),
    lambda d: d["plan"].update(future_key="ignored"),
    lambda d: (d["plan"].update(fields=[], groups=[], planes=[]), d.update(group_specs=[])),
    lambda d: d.update(group_specs=[]),
    lambda d: d["group_specs"][0].update(anything={"nested": [True]}),
    lambda d: d["transfer_schema"].update(fields=[{"field_id": "layer.0.kv"}], version=2),
    lambda d: first_field(d).update(shape=[]),
    lambda d: first_field(d).update(dtype="float8_e8m0fnu"),
], ids=["field-addresses", "unknown-top-level-key", "no-field-addresses", "no-resident-bytes",
        "resident-bytes", "unknown-plan-key", "empty-plan", "no-group-specs", "group-spec-extras",
        "transfer-schema-extras", "scalar-field", "float8-e8m0"])
def test_these_layouts_are_valid(mutate: Mutation) -> None:
    assert is_valid(wire_of(mutate))


@pytest.mark.parametrize("dtype", [
    "uint8", "int8", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
    "bfloat16", "float16", "int32", "float32", "int64", "float64",
])
def test_each_cache_dtype_is_allowed(dtype: str) -> None:
    assert is_valid(wire_of(lambda d: first_field(d).update(dtype=dtype)))


def test_plan_groups_planes_and_fields_must_be_lists() -> None:
    for key in ("groups", "planes", "fields"):
        assert not is_valid(wire_of(lambda d, key=key: d["plan"].update({key: {}})))


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("plan"),
    lambda d: d.pop("group_specs"),
    lambda d: d.pop("transfer_schema"),
    lambda d: d["plan"].pop("prefix_granularity"),
    lambda d: d["plan"].pop("lcm_block_bytes"),
    lambda d: d["plan"].pop("num_lcm_blocks"),
    lambda d: d["plan"].pop("groups"),
    lambda d: d["plan"].pop("planes"),
    lambda d: d["plan"].pop("fields"),
    lambda d: d["plan"].update(lcm_block_bytes="64"),
    lambda d: d["plan"].update(lcm_block_bytes=64.0),
    lambda d: d["plan"].update(num_lcm_blocks=True),
    lambda d: d["plan"].update(prefix_granularity=-16),
    lambda d: d["plan"].update(resident_block_bytes="4096"),
    lambda d: d["plan"]["groups"][0].update(extra=1),
    lambda d: d["plan"]["groups"][0].pop("page_count"),
    lambda d: d["plan"]["planes"][0].update(extra=1),
    lambda d: d["plan"]["planes"][0].pop("arena_offset_bytes"),
    lambda d: first_field(d).update(extra=1),
    lambda d: first_field(d).pop("page_stride_bytes"),
    lambda d: first_field(d).update(dtype="float128"),
    lambda d: first_field(d).update(shape=16),
    lambda d: first_field(d).update(shape=["16"]),
    lambda d: first_field(d).update(field_id="layer.1.kv"),
    lambda d: first_field(d).update(group_id="nope"),
    lambda d: first_field(d).update(plane_id="nope"),
    lambda d: first_field(d).update(field_id=0),
    lambda d: d["group_specs"][0].update(group_id="nope"),
    lambda d: d["group_specs"][0].pop("group_id"),
    lambda d: d.update(group_specs=["kv"]),
    lambda d: d.update(group_specs={"group_id": "kv"}),
    lambda d: d.update(transfer_schema={}),
    lambda d: d.update(transfer_schema={"fields": {}}),
    lambda d: d.update(transfer_schema=[]),
], ids=[
    "no-plan", "no-group-specs", "no-transfer-schema", "no-prefix-granularity", "no-lcm-block-bytes",
    "no-num-lcm-blocks", "no-groups", "no-planes", "no-fields", "integer-as-string", "integer-as-float",
    "integer-as-bool", "negative-integer", "resident-bytes-as-string", "group-extra-key",
    "group-missing-key", "plane-extra-key", "plane-missing-key", "field-extra-key", "field-missing-key",
    "unknown-dtype", "shape-not-a-list", "shape-of-strings", "duplicate-field-id", "field-unknown-group",
    "field-unknown-plane", "field-id-not-a-string", "spec-unknown-group", "spec-without-group-id",
    "spec-not-an-object", "specs-not-a-list", "schema-without-fields", "schema-fields-not-a-list",
    "schema-not-an-object",
])
def test_these_layouts_are_invalid(mutate: Mutation) -> None:
    assert not is_valid(wire_of(mutate))


@pytest.mark.parametrize("wire", ["", "null", "[]", "\"plan\"", "{", "{\"plan\": {}}"])
def test_a_wire_form_that_is_not_a_layout_object_is_invalid(wire: str) -> None:
    assert not is_valid(wire)


def test_a_layout_may_be_262144_bytes_and_no_more() -> None:
    base = json.dumps({**layout_dict(), "field_addresses": ""})
    padding = MAX_LAYOUT_BYTES - len(base)
    at_limit = json.dumps({**layout_dict(), "field_addresses": "x" * padding})
    assert len(at_limit) == MAX_LAYOUT_BYTES
    assert is_valid(at_limit)
    assert not is_valid(json.dumps({**layout_dict(), "field_addresses": "x" * (padding + 1)}))


def test_layouts_differing_in_key_order_and_whitespace_are_the_same() -> None:
    data = layout_dict()
    reordered = json.dumps(dict(reversed(list(data.items()))), indent=4)
    other = CacheLayout.from_wire(reordered)
    assert other.same_as(CacheLayout.from_wire(layout()))


def test_layouts_differing_in_list_order_are_not_the_same() -> None:
    swapped = wire_of(lambda d: d["plan"]["fields"].reverse())
    assert not CacheLayout.from_wire(swapped).same_as(CacheLayout.from_wire(layout()))


def test_a_kept_value_true_is_not_the_same_as_one() -> None:
    true = CacheLayout.from_wire(wire_of(lambda d: d["group_specs"][0].update(replayable=True)))
    one = CacheLayout.from_wire(wire_of(lambda d: d["group_specs"][0].update(replayable=1)))
    assert not true.same_as(one)


# --- the registration refusals, in order --------------------------------------------------------

def refusal_of(registry: BootstrapRegistry, body: dict[str, Any]) -> str:
    with pytest.raises(Refusal) as refused:
        registry.register(orjson.dumps(body))
    assert refused.value.status == 500
    return refused.value.message


def cache_table() -> BootstrapRegistry:
    return BootstrapRegistry("cache-layouts")


@pytest.mark.parametrize("value", [None, 42, ["{}"], {"plan": {}}, "{\"plan\": \"é\"}"])
def test_a_layout_that_is_not_an_ascii_string_is_refused(value: Any) -> None:
    body = cache_registration(0, wire="")
    body["cache_layout"] = value
    assert refusal_of(cache_table(), body) == "CachePD bootstrap layout must be a string"


def test_a_registration_without_a_layout_is_refused() -> None:
    body = cache_registration(0)
    del body["cache_layout"]
    assert refusal_of(cache_table(), body) == "CachePD bootstrap layout must be a string"


def test_an_invalid_layout_is_refused() -> None:
    assert refusal_of(cache_table(), cache_registration(0, wire="{}")) == "CachePD bootstrap layout is invalid"


@pytest.mark.parametrize("stages", [None, "layer.0.kv", {"0": ["layer.0.kv"]}, ["layer.0.kv", "layer.1.kv"],
                                    [["layer.0.kv"], "layer.1.kv"]])
def test_a_placement_that_is_not_a_list_of_lists_is_refused(stages: Any) -> None:
    body = cache_registration(0, pp_size=2)
    body["cache_fields_by_stage"] = stages
    assert refusal_of(cache_table(), body) == "CachePD requires explicit stage field placement"


def test_a_registration_without_a_placement_is_refused() -> None:
    body = cache_registration(0)
    del body["cache_fields_by_stage"]
    assert refusal_of(cache_table(), body) == "CachePD requires explicit stage field placement"


@pytest.mark.parametrize("stages", [
    [["layer.0.kv"]],
    [["layer.0.kv"], ["layer.0.kv", "layer.1.kv"]],
    [["layer.0.kv", "layer.0.kv"], ["layer.1.kv"]],
    [["layer.0.kv"], ["layer.1.kv", "layer.2.kv"]],
    [["layer.0.kv"], [1]],
    [[], []],
], ids=["missing-field", "named-twice-across-stages", "named-twice-in-a-stage", "unknown-field",
        "not-a-string", "empty"])
def test_a_placement_not_covering_every_field_exactly_once_is_refused(stages: list[list[Any]]) -> None:
    assert refusal_of(cache_table(), cache_registration(0, stages=stages)) == (
        "cache stage placement must cover every logical field exactly once")


def test_empty_stages_are_allowed() -> None:
    registry = cache_table()
    registry.register(orjson.dumps(cache_registration(0, stages=[["layer.0.kv", "layer.1.kv"], []])))
    assert registry.route(SIZES)["cache_fields_by_stage"] == [["layer.0.kv", "layer.1.kv"], []]


@pytest.mark.parametrize("pp_size", [1, 3, "1"])
def test_a_stage_count_other_than_pp_size_is_refused(pp_size: Any) -> None:
    assert refusal_of(cache_table(), cache_registration(0, pp_size=pp_size)) == (
        "CachePD placement does not match pipeline stage count")


def test_a_cache_registration_needs_a_pp_size() -> None:
    body = cache_registration(0)
    del body["pp_size"]
    assert refusal_of(cache_table(), body) == "missing pp_size"


def test_a_pp_size_given_as_a_string_counts() -> None:
    registry = cache_table()
    registry.register(orjson.dumps(cache_registration(0, pp_size="2")))
    assert registry.route(SIZES)["prefill_pp_size"] == 2


def test_a_placement_other_than_the_registered_one_is_refused() -> None:
    registry = cache_table()
    registry.register(orjson.dumps(cache_registration(0)))
    other = [["layer.1.kv"], ["layer.0.kv"]]
    assert refusal_of(registry, cache_registration(1, stages=other)) == (
        "CachePD prefill ranks registered incompatible field placement")


def test_a_layout_other_than_the_registered_one_is_refused() -> None:
    registry = cache_table()
    registry.register(orjson.dumps(cache_registration(0)))
    assert refusal_of(registry, cache_registration(1, wire=layout(9))) == (
        "CachePD prefill ranks registered incompatible layouts")


def test_the_placement_is_checked_before_the_layout() -> None:
    registry = cache_table()
    registry.register(orjson.dumps(cache_registration(0)))
    body = cache_registration(1, wire=layout(9), stages=[["layer.1.kv"], ["layer.0.kv"]])
    assert refusal_of(registry, body) == "CachePD prefill ranks registered incompatible field placement"


def test_the_same_layout_spelled_differently_is_accepted_and_the_first_spelling_served() -> None:
    registry = cache_table()
    registry.register(orjson.dumps(cache_registration(0)))
    respelled = json.dumps(layout_dict(), indent=2, sort_keys=True)
    registry.register(orjson.dumps(cache_registration(1, wire=respelled)))
    assert registry.route(SIZES)["cache_layout"] == layout()
    assert registry.registered_ranks == 2


def test_a_refused_layout_records_nothing() -> None:
    registry = cache_table()
    refusal_of(registry, cache_registration(0, stages=[["layer.0.kv"]]))
    assert registry.route(SIZES) == {
        "prefill_tp_size": None, "prefill_dp_size": None, "prefill_pp_size": 1,
        "cache_layout": None, "cache_fields_by_stage": None,
    }
    registry.register(orjson.dumps(cache_registration(0, wire=layout(9))))
    assert registry.route(SIZES)["cache_layout"] == layout(9)


def test_a_layout_accepted_with_a_registration_refused_later_is_not_recorded() -> None:
    registry = cache_table()
    refusal_of(registry, cache_registration(0, dp_size=0))
    assert registry.route(SIZES)["cache_layout"] is None


def test_a_decode_rank_of_a_cache_node_is_checked_too() -> None:
    body = cache_registration(0, stages=[["layer.0.kv"]], role="Decode")
    assert refusal_of(cache_table(), body) == (
        "cache stage placement must cover every logical field exactly once")


def test_an_addresses_registry_ignores_cache_keys() -> None:
    registry = BootstrapRegistry("addresses")
    registry.register(orjson.dumps(registration(0, cache_layout=42, cache_fields_by_stage="none")))
    assert "cache_layout" not in registry.route(SIZES)
