"""A stream survives the death of its tail: the head moves it to the replica and the client sees nothing.

Three node processes and a tracker (tests/failover_mesh.py): ``head`` holds
layers 0-1; ``tail-a`` and ``tail-b`` both hold 2-3. A streamed chat goes
through the tracker's front door; after some tokens the test SIGKILLs
whichever tail serves it. The head must report the dead tail, replay the
session's history through the other one and carry on: the streamed text
equals an uninterrupted run, greedy and seeded alike, with no error event.
"""

from __future__ import annotations

import json
from typing import Final

import httpx
import jsonschema
from prometheus_client.parser import text_string_to_metric_families

from meshwire import headers as h
from meshwire.auth import bearer_headers
from tests.failover_mesh import (
    JSON_LIST_SCHEMA,
    STRUCTURED,
    FailoverMesh,
    StreamResult,
    mesh_fixtures,
    wait_for,
)
from tests.procs import TEST_SECRET

TAILS: Final = ("tail-a", "tail-b")
LAYERS: Final = {"head": (0, 1), "tail-a": (2, 3), "tail-b": (2, 3)}
MAX_TOKENS: Final = 300
KILL_AFTER_CHUNKS: Final = 20
SEEDED: Final = {"temperature": 0.8, "seed": 1}


mesh, whole = mesh_fixtures(LAYERS)


def head_failovers(mesh: FailoverMesh) -> float:
    """The head's ``meshnet_node_failovers_total{reason="failed", outcome="moved"}``."""
    text = httpx.get(f"{mesh.nodes['head'].url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "meshnet_node_failovers_total"
               and sample.labels == {"reason": "failed", "outcome": "moved"})


def assert_continued_seamlessly(mesh: FailoverMesh, broken: StreamResult, whole_run: StreamResult) -> None:
    assert whole_run.finish_reason == "length" and whole_run.completion_tokens == MAX_TOKENS, \
        "the uninterrupted run must not end early, or the kill could miss the stream"
    assert broken.killed is not None and broken.chunks_before_kill < whole_run.content_chunks
    assert mesh.node_view()[broken.killed]["failures"] == 1, "the head met the dead tail and reported it"
    assert broken.errors == []
    assert head_failovers(mesh) >= 1, "the head's metrics count the move"
    assert broken.text == whole_run.text
    assert (broken.finish_reason, broken.completion_tokens, broken.done) == ("length", MAX_TOKENS, True)


def test_a_greedy_stream_outlives_its_tail_which_is_reported_and_kept_out_of_routes(mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS)

    broken = mesh.stream(MAX_TOKENS, kill_one_of=TAILS, kill_after_chunks=KILL_AFTER_CHUNKS)

    assert_continued_seamlessly(mesh, broken, whole_run)
    dead = mesh.node_view()[broken.killed]
    assert dead["last_failure_reason"] and dead["backoff_remaining_s"] > 0
    survivor = next(name for name in TAILS if name != broken.killed)
    route = mesh.route()
    assert route.status_code == 200, route.text
    assert [hop["node_id"] for hop in route.json()["nodes"]] == ["head", survivor]


def test_a_seeded_stream_outlives_its_tail_and_samples_the_same_tokens(mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS, SEEDED)
    broken = mesh.stream(MAX_TOKENS, SEEDED, kill_one_of=TAILS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert_continued_seamlessly(mesh, broken, whole_run)


def test_a_structured_stream_outlives_its_tail_and_the_new_tail_follows_the_grammar_from_where_it_was(
        mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS, STRUCTURED)
    assert whole_run.finish_reason == "stop" and whole_run.content_chunks > KILL_AFTER_CHUNKS, whole_run
    broken = mesh.stream(MAX_TOKENS, STRUCTURED, kill_one_of=TAILS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.killed is not None and broken.errors == [] and head_failovers(mesh) >= 1
    assert broken.text == whole_run.text and broken.finish_reason == "stop"
    jsonschema.validate(json.loads(broken.text), JSON_LIST_SCHEMA)


def test_a_tail_killed_mid_stream_and_restarted_on_its_port_comes_back_and_serves(mesh: FailoverMesh) -> None:
    expected = mesh.chat(40)
    assert expected.status_code == 200, expected.text
    broken = mesh.stream(MAX_TOKENS, kill_one_of=TAILS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.killed is not None and broken.errors == []
    other = next(name for name in TAILS if name != broken.killed)

    mesh.revive(broken.killed)
    back = mesh.node_view()[broken.killed]
    assert (back["state"], back["failures"], back["backoff_remaining_s"]) == ("online", 0, 0)
    route = mesh.route(exclude=(other,))
    assert route.status_code == 200, route.text
    assert [hop["node_id"] for hop in route.json()["nodes"]] == ["head", broken.killed]
    answer = httpx.post(f"{mesh.nodes['head'].url}/v1/chat/completions", timeout=60,
                        headers={h.ROUTE: route.json()["token"], **bearer_headers(TEST_SECRET)}, json=mesh.body(40, None, stream=False))
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == expected.json()["choices"][0]["message"]["content"]
    wait_for(mesh.idle, "the request to leave no session behind")
