"""The prefill/decode handoff's pieces without a model: the prefill group, the layout, the wire, the planner,
and the bootstrap registry (a real process) accepting a prefill group and refusing a disagreeing layout."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from meshwire.forward_step import DataRequest, StepInfo, parse_forward
from meshwire.frames import FrameError, encode_frame
from meshwire.kv_box import BoxProblem, Opener, check_box, seal
from meshwire.kv_handoff import (
    PAGE_TOKENS,
    HandoffSource,
    KVShape,
    cache_layout,
    chunk_positions,
    layout_difference,
    layout_wire,
    placement_layers,
    pull_answer_problem,
    route_digest,
    sign_pull_answer,
    stage_placement,
)
from meshwire.limits import MAX_HEADER_VALUE_CHARS
from meshwire.pd_group import PrefillMember, plan_prefill_group
from meshwire.registry import RegistrationAnswer
from meshwire.route_keys import KeySet, SigningKey
from meshwire.routes import Route, RouteNode, issue_signed_route
from services.bootstrap.layout import check_placement_covers, parse_layout_wire
from services.node.engine.sessions import SessionRefused, SessionTable
from services.node.hop.trust import RouteTrust
from services.node.pd.handoff_limits import HandoffLimits
from services.node.pd.kv_pull import HandoffFailed, KvPuller
from services.node.pd.pd_member import PrefillMembership, rank_address
from services.tracker.pd_routes import plan_prefill_route
from services.tracker.planner import Candidate
from services.tracker.state import _plan_decode_route
from tests.procs import Service, start_service

HOP_KEY = SigningKey.generate()
ROUTE_KEY = SigningKey.generate()
"""The test's tracker key: the pullers below trust it."""
F32 = KVShape(num_layers=4, kv_heads=2, head_dim=16, dtype="float32", itemsize=4, max_positions=4096)
BF16 = KVShape(num_layers=4, kv_heads=2, head_dim=16, dtype="bfloat16", itemsize=2, max_positions=4096)


def puller(bootstrap_url: str, shape: KVShape, timeout_s: float) -> KvPuller:
    """A decode node's puller (node ``d``) that trusts routes signed with :data:`ROUTE_KEY` for model ``m``."""
    return KvPuller(node_id="d", hop_key=HOP_KEY, trust=RouteTrust(KeySet.of([ROUTE_KEY]), None), model_id="m",
                    bootstrap_url=bootstrap_url, shape=shape, max_chunk_bytes=1 << 20, timeout_s=timeout_s)


def prefill_route(endpoint: str, key: SigningKey = ROUTE_KEY, model: str = "m") -> str:
    """A signed prefill route of one prefill node ``p`` (every layer) at ``endpoint``."""
    node = RouteNode(node_id="p", endpoint=endpoint, shard_start=0, shard_end=3,
                     hop_key=SigningKey.generate().public_text)
    return issue_signed_route(Route(model=model, nodes=(node,), num_layers=4), key).token


# --- the prefill group ------------------------------------------------------------------------------------------


def test_prefill_nodes_whose_ranges_tile_the_layers_form_stages_and_replicas_with_dense_stage_major_ranks() -> None:
    members = [PrefillMember("b1", 2, 3), PrefillMember("a0", 0, 1), PrefillMember("a1", 0, 1),
               PrefillMember("b0", 2, 3), PrefillMember("c", 0, 1)]
    group = plan_prefill_group(members, 4)
    assert group is not None
    assert group.stages == ((0, 1), (2, 3)) and group.dp_size == 2 and group.pp_size == 2
    assert group.replicas == (("a0", "b0"), ("a1", "b1"))
    ranks = {node: group.assignment(node) for node in ("a0", "b0", "a1", "b1")}
    assert {node: (a.engine_rank, a.dp_group, a.stage) for node, a in ranks.items() if a} == {
        "a0": (0, 0, 0), "b0": (1, 0, 1), "a1": (2, 1, 0), "b1": (3, 1, 1)}
    assert all(a is not None and (a.world_size, a.dp_size, a.pp_size) == (4, 2, 2) for a in ranks.values())
    assert group.assignment("c") is None  # a third node of stage 0 waits outside: stage 1 has two


@pytest.mark.parametrize("ranges", [[(0, 1)], [(0, 1), (3, 3)], [(0, 2), (2, 3)], [(0, 3), (0, 1), (2, 3)], []])
def test_prefill_ranges_that_leave_a_gap_or_overlap_form_no_group(ranges: list[tuple[int, int]]) -> None:
    assert plan_prefill_group([PrefillMember(f"n{i}", a, b) for i, (a, b) in enumerate(ranges)], 4) is None


# --- the cache layout ----------------------------------------------------------------------------------------------


def test_the_layout_is_one_the_bootstrap_registry_accepts_and_the_placement_covers_it() -> None:
    wire = layout_wire(cache_layout(F32))
    _, layout = parse_layout_wire(wire)
    stages = stage_placement([(0, 1), (2, 3)])
    check_placement_covers(layout, stages)
    assert stages == [["layer.0.kv", "layer.1.kv"], ["layer.2.kv", "layer.3.kv"]]
    assert placement_layers(stages) == [(0, 1), (2, 3)]
    field = cache_layout(F32)["plan"]["fields"][1]
    assert (field["shape"], field["dtype"], field["field_offset_bytes"]) == ([2, 2, 16], "float32", 2 * 2 * 16 * 4 * 16)


def test_a_layout_of_another_dtype_is_named_as_the_difference() -> None:
    assert layout_difference(cache_layout(F32), layout_wire(cache_layout(F32))) is None
    why = layout_difference(cache_layout(F32), layout_wire(cache_layout(BF16)))
    assert why is not None and "bfloat16" in why and "float32" in why
    assert layout_difference(cache_layout(F32), None) is not None
    assert layout_difference(cache_layout(F32), "not json") is not None


def test_pull_chunks_are_whole_pages_within_the_byte_limit_and_at_least_one_page() -> None:
    per_page = 3 * F32.position_bytes_per_layer * PAGE_TOKENS
    assert chunk_positions(3, F32, 5 * per_page + 1) == 5 * PAGE_TOKENS
    assert chunk_positions(3, F32, 10) == PAGE_TOKENS


# --- the frame headers -------------------------------------------------------------------------------------------


def test_handoff_headers_go_along_a_frame_and_read_back() -> None:
    source = HandoffSource(session="s-abc", dp_group=1, positions=77)
    assert HandoffSource.parse(source.header()) == source
    for bad in ("dp=1;n=0;s=s-abc", "dp=x;n=1;s=a", "n=1;s=a", "dp=1;n=1;s=bad id"):
        with pytest.raises(FrameError):
            HandoffSource.parse(bad)
    digest = route_digest("a.decode.route")
    assert digest == route_digest("a.decode.route") != route_digest("another.decode.route")
    info = StepInfo(route_token="r.t", hop_index=1, start_layer=2, step=0, position_offset=77, hold=digest,
                    handoff=source)
    headers, _ = encode_frame(torch.zeros(1, 1, 8), session="s-new", extra=info.headers())
    parsed = parse_forward(headers)
    assert isinstance(parsed, DataRequest)
    assert parsed.info.handoff == source and parsed.info.hold == digest
    for bad in ("1", "yes", digest[:-1], digest.upper()):  # the hold names the decode route it is for
        with pytest.raises(FrameError):
            parse_forward({**headers, "X-Meshnet-Handoff-Hold": bad})


# --- the tracker's routes ------------------------------------------------------------------------------------------


def candidate(node_id: str, start: int, end: int, role: str, pd_rank: int | None = None, sessions: int = 0,
              backoff: bool = False) -> Candidate:
    return Candidate(node_id=node_id, endpoint=f"http://{node_id}:1", shard_start=start, shard_end=end, role=role,
                     pd_rank=pd_rank, active_sessions=sessions, backoff=backoff)


def test_the_prefill_route_is_the_least_loaded_ready_replica_in_stage_order() -> None:
    nodes = [candidate("a0", 0, 1, "prefill", 0, sessions=3), candidate("b0", 2, 3, "prefill", 1),
             candidate("a1", 0, 1, "prefill", 2), candidate("b1", 2, 3, "prefill", 3),
             candidate("d", 0, 3, "decode")]
    hops = plan_prefill_route(nodes, 4)
    assert hops is not None and [(n.node_id, n.start_layer) for n in hops] == [("a1", 0), ("b1", 2)]
    not_registered = [*nodes[:3], candidate("b1", 2, 3, "prefill", None), nodes[4]]
    assert [n.node_id for n in plan_prefill_route(not_registered, 4) or ()] == ["a0", "b0"]
    assert plan_prefill_route([nodes[0], nodes[4]], 4) is None  # no group: stage 2-3 missing
    assert plan_prefill_route([candidate("a", 0, 3, "prefill", None)], 4) is None  # not in the registry yet


def test_decode_and_plain_routes_leave_prefill_nodes_out_unless_nobody_else_holds_their_layers() -> None:
    nodes = [candidate("p", 0, 3, "prefill", 0), candidate("d", 0, 3, "decode")]
    assert [n.node_id for n in _plan_decode_route(nodes, 4, frozenset())] == ["d"]
    assert [n.node_id for n in _plan_decode_route(nodes[:1], 4, frozenset())] == ["p"]


# --- the bootstrap registry, a real process -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bootstrap() -> Iterator[Service]:
    with start_service("bootstrap", {"MESHNET_REGISTRY": "cache-layouts"}) as service:
        yield service


def test_prefill_nodes_register_their_group_and_a_node_of_another_layout_is_refused(bootstrap: Service) -> None:
    group = plan_prefill_group([PrefillMember("p0", 0, 1), PrefillMember("p1", 2, 3)], 4)
    assert group is not None

    async def scenario() -> tuple[PrefillMembership, PrefillMembership]:
        good = PrefillMembership(bootstrap_url=bootstrap.url, public_url="http://127.0.0.1:7001", shape=F32,
                                 node_id="p0", hop_key=SigningKey.generate())
        bad = PrefillMembership(bootstrap_url=bootstrap.url, public_url="http://127.0.0.1:7002", shape=BF16,
                                node_id="p1", hop_key=SigningKey.generate())
        for member, node in ((good, "p0"), (bad, "p1")):
            member.on_answer(RegistrationAnswer(lease="l", heartbeat_s=1, ttl_s=2,
                                                prefill_group=group.assignment(node)))
            assert member._task is not None
            await member._task
        await good.aclose()
        await bad.aclose()
        return good, bad

    good, bad = asyncio.run(scenario())
    assert good.pd_rank == 0 and good.error is None
    assert bad.pd_rank is None and bad.error == "CachePD prefill ranks registered incompatible layouts"
    sizes = httpx.get(f"{bootstrap.url}/route", params={"engine_rank": -1, "target_dp_group": -1}).json()
    assert (sizes["prefill_tp_size"], sizes["prefill_dp_size"], sizes["prefill_pp_size"]) == (2, 1, 2)
    assert sizes["cache_fields_by_stage"] == stage_placement([(0, 1), (2, 3)])
    assert httpx.get(f"{bootstrap.url}/route", params={"engine_rank": 0, "target_dp_group": 0}).json() == {
        "rank_ip": "127.0.0.1", "rank_port": 7001}
    assert httpx.get(f"{bootstrap.url}/route", params={"engine_rank": 1, "target_dp_group": 0}).status_code == 500

    async def problems() -> tuple[HandoffFailed | None, HandoffFailed | None]:
        same = puller(bootstrap.url, F32, timeout_s=5)
        other = puller(bootstrap.url, BF16, timeout_s=5)
        out = (await same.layout_problem(), await other.layout_problem())
        await same.aclose()
        await other.aclose()
        return out

    same, other = asyncio.run(problems())
    assert same is None
    assert other is not None and other.reason == "layout_mismatch"
    assert "bfloat16" in str(other) and "float32" in str(other) and "prefills the prompt itself" in str(other)


def test_a_rank_address_is_the_host_and_port_the_node_is_reached_at() -> None:
    assert rank_address("http://10.0.0.5:8101") == ("10.0.0.5", 8101)
    assert rank_address("https://node.example") == ("node.example", 443)


def test_a_pull_from_a_prefill_node_that_never_answers_times_out_as_a_handoff_failure(bootstrap: Service) -> None:
    """A prefill node (named by the signed prefill route) that accepts the connection and never answers: the pull
    gives up after its timeout (the decode route then prefills itself). Runs after the registration test, whose
    layout it reuses."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]

    async def pull() -> HandoffFailed:
        pulling = puller(bootstrap.url, F32, timeout_s=1.0)
        try:
            source = HandoffSource("s-x", 0, 40, route=prefill_route(f"http://127.0.0.1:{port}"))
            await pulling.pull_into(None, source, 0, 1, "cpu", "a.route")  # type: ignore[arg-type]
        except HandoffFailed as exc:
            return exc
        finally:
            await pulling.aclose()
        raise AssertionError("the pull did not fail")

    try:
        failure = asyncio.run(pull())
    finally:
        silent.close()
    assert failure.reason == "timeout"


@pytest.mark.parametrize(("route", "why"), [
    (None, "names no signed prefill route"),
    ("not.a.route", "prefill route is refused"),
    (lambda: prefill_route("http://169.254.169.254:80"), "cloud metadata address"),
    (lambda: prefill_route("http://[fe80::1]:8000"), "link-local"),
    (lambda: prefill_route("http://127.0.0.1:9", key=SigningKey.generate()), "prefill route is refused"),
    (lambda: prefill_route("http://127.0.0.1:9", model="another"), "is for another"),
], ids=["no-route", "garbage", "metadata", "link-local", "forged", "other-model"])
def test_a_handoff_whose_prefill_route_is_missing_forged_or_names_a_forbidden_address_is_not_pulled(
        bootstrap: Service, route: Any, why: str) -> None:
    """The decode side pulls only from an endpoint the tracker's signed prefill route names, never a metadata or
    link-local one (an SSRF), and no pull is made at all otherwise."""
    token = route() if callable(route) else route

    async def pull() -> HandoffFailed:
        pulling = puller(bootstrap.url, F32, timeout_s=5.0)
        try:
            await pulling.pull_into(None, HandoffSource("s-x", 0, 40, route=token), 0, 1,  # type: ignore[arg-type]
                                    "cpu", "a.route")
        except HandoffFailed as exc:
            return exc
        finally:
            await pulling.aclose()
        raise AssertionError("the pull did not fail")

    failure = asyncio.run(pull())
    assert failure.reason == "bad_route" and why in str(failure), str(failure)


def test_a_pull_answer_verifies_only_as_the_named_nodes_answer_to_that_very_pull() -> None:
    """Signed by the prefill node over the chunk, the puller and the pull's proof: another key, another signer,
    another puller, another pull (a replayed old answer) or altered bytes or headers do not verify."""
    prefill_key = SigningKey.generate()
    headers, body = encode_frame(torch.arange(8, dtype=torch.float32).reshape(1, 2, 4), session="s-a")
    headers = {**headers, "X-Meshnet-KV-Positions": "2"}
    answer = {**headers, **sign_pull_answer(prefill_key, "p", headers, body, requester="d", request_proof="1.proof")}
    public = prefill_key.private.public_key()

    def problem(**change: Any) -> str | None:
        args: dict[str, Any] = {"key": public, "signer": "p", "headers": answer, "body": body, "requester": "d",
                                "request_proof": "1.proof", **change}
        return pull_answer_problem(args.pop("key"), args.pop("signer"), args.pop("headers"), args.pop("body"),
                                   **args)

    assert problem() is None
    assert problem(key=SigningKey.generate().private.public_key()) is not None
    assert problem(signer="q") is not None
    assert problem(requester="e") is not None, "an answer made for another decode node"
    assert problem(request_proof="2.proof") is not None, "an old answer replayed to a new pull"
    assert problem(body=body[:-1] + b"x") is not None
    assert problem(headers={**answer, "X-Meshnet-KV-Positions": "3"}) is not None
    assert problem(headers=headers) is not None, "an unsigned answer"


def test_handoff_routes_go_along_a_frame_and_read_back() -> None:
    source = HandoffSource(session="s-abc", dp_group=1, positions=77, route="a.prefill.route")
    info = StepInfo(route_token="r.t", hop_index=1, start_layer=2, step=0, position_offset=77, handoff=source)
    headers, _ = encode_frame(torch.zeros(1, 1, 8), session="s-new", extra=info.headers())
    parsed = parse_forward(headers)
    assert isinstance(parsed, DataRequest) and parsed.info.handoff == source
    with pytest.raises(FrameError):
        HandoffSource.parse(source.header(), route="x" * (MAX_HEADER_VALUE_CHARS + 1))


# --- the held handoffs on a prefill node ----------------------------------------------------------------------------


class _Cache:
    def __init__(self, tokens: int, nbytes: int) -> None:
        self.seq_len = tokens
        self._nbytes = nbytes

    def nbytes(self) -> int:
        return self._nbytes


def test_held_handoffs_are_counted_bounded_and_freed_by_the_sweeper_after_their_ttl() -> None:
    now = [100.0]
    table = SessionTable(kv_budget_tokens=10_000, max_sessions=16, idle_timeout_s=300, clock=lambda: now[0],
                         handoff_ttl_s=10)
    expired: list[int] = []
    table.on_handoff_expired = expired.append
    limits = HandoffLimits(max_held=2, max_bytes=1000, position_bytes=1)
    held = table.open("s-a", 10, _Cache(10, 400))
    table.hold(held)
    limits.check_room(table, 10, 4)
    other = table.open("s-b", 10, _Cache(10, 500))
    other.hold = True  # being prefilled: counted already, not yet held (no TTL)
    assert table.handoffs == 2 and table.handoff_bytes() == 900
    with pytest.raises(SessionRefused):
        limits.check_room(table, 1, 1)  # two held: the count bound
    table.close("s-b")
    with pytest.raises(SessionRefused):
        limits.check_room(table, 200, 4)  # 400 held + 800 > 1000: the byte bound
    assert table.sweep_interval_s() == 2.5
    now[0] += 9.9
    table.sweep()
    assert "s-a" in table and expired == []
    now[0] += 0.2
    table.sweep()
    assert "s-a" not in table and expired == [1] and table.handoffs == 0


def test_a_chunk_sealed_to_a_pulls_key_opens_only_with_that_key_and_that_pulls_proof() -> None:
    puller = Opener()
    box, sealed = seal(puller.public_text, b"kv bytes" * 100, "1.proof")
    assert puller.open(box, sealed, "1.proof") == b"kv bytes" * 100
    for opener, context in ((Opener(), "1.proof"), (puller, "2.proof")):
        with pytest.raises(BoxProblem):
            opener.open(box, sealed, context)
    with pytest.raises(BoxProblem):
        check_box("not-a-key")
