"""A stream survives the death of its head: the tracker continues it on another head (meshwire.resume).

A tracker and three node processes (tests/failover_mesh.py): ``head-a`` and
``head-b`` both hold layers 0-1, ``tail`` holds 2-3. A streamed chat goes
through the tracker; after some tokens the test SIGKILLs whichever head
serves it. The tracker, which kept the token ids behind every event, sends
the request with that history to the other head, which replays it and goes
on: the client's stream equals an uninterrupted run (greedy and seeded), one
stream id, no second opening, no error event, the right finish and usage.
"""

from __future__ import annotations

import json
import threading
from typing import Final

import httpx
import jsonschema
import orjson
from prometheus_client.parser import text_string_to_metric_families

from meshwire.sse import parse_sse_line
from tests.failover_mesh import JSON_LIST_SCHEMA, STRUCTURED, FailoverMesh, mesh_fixtures, wait_for

HEADS: Final = ("head-a", "head-b")
LAYERS: Final = {"head-a": (0, 1), "head-b": (0, 1), "tail": (2, 3)}
MAX_TOKENS: Final = 200
KILL_AFTER_CHUNKS: Final = 15
SEEDED: Final = {"temperature": 0.8, "seed": 7}


def tokens_generated(mesh: FailoverMesh, name: str) -> float:
    """The head ``name``'s ``meshnet_node_tokens_generated_total``."""
    text = httpx.get(f"{mesh.nodes[name].url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "meshnet_node_tokens_generated_total")


class FailoverEvidence:
    """What shows a failover happened: taken before a request, checked after it named the head it killed."""

    def __init__(self, mesh: FailoverMesh) -> None:
        self._mesh = mesh
        self._log_lines = {name: self._continued_lines(name) for name in HEADS}
        self._tokens = {name: tokens_generated(mesh, name) for name in HEADS}

    def _continued_lines(self, head: str) -> int:
        """The tracker's log lines saying ``head`` broke mid-answer and the answer goes on elsewhere."""
        return sum(f"head {head} stopped answering" in line and "continuing elsewhere" in line
                   for line in self._mesh.tracker.log().splitlines())

    def check(self, killed: str) -> None:
        """The tracker logged that ``killed`` broke mid-answer, and the other head generated the rest."""
        survivor = next(name for name in HEADS if name != killed)
        assert self._continued_lines(killed) == self._log_lines[killed] + 1, self._mesh.tracker.log()[-3000:]
        assert tokens_generated(self._mesh, survivor) > self._tokens[survivor], f"{survivor} generated nothing"


# A dead head cannot close its session on the tail: the tail's idle expiry frees it, soon enough for the
# next test's wait for an idle mesh.
mesh, whole = mesh_fixtures(LAYERS, {"MESHNET_IDLE_TIMEOUT_S": "5"})


def test_a_greedy_stream_outlives_its_head_and_equals_the_uninterrupted_run(mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS)
    assert whole_run.finish_reason == "length" and whole_run.content_chunks > KILL_AFTER_CHUNKS

    evidence = FailoverEvidence(mesh)
    broken = mesh.stream(MAX_TOKENS, kill_one_of=HEADS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.killed is not None
    evidence.check(broken.killed)

    assert broken.killed in HEADS and broken.chunks_before_kill < whole_run.content_chunks
    assert broken.errors == []
    assert broken.text == whole_run.text
    assert (broken.finish_reason, broken.completion_tokens, broken.done) == ("length", MAX_TOKENS, True)
    assert mesh.node_view()[broken.killed]["failures"] >= 1, "the tracker reported the dead head"


def test_a_seeded_stream_outlives_its_head_and_samples_the_same_tokens(mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS, SEEDED)
    evidence = FailoverEvidence(mesh)
    broken = mesh.stream(MAX_TOKENS, SEEDED, kill_one_of=HEADS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.errors == [] and broken.killed in HEADS
    evidence.check(broken.killed)
    assert broken.text == whole_run.text and broken.finish_reason == whole_run.finish_reason


def test_a_structured_stream_outlives_its_head_and_the_grammar_goes_on_from_the_replayed_tokens(
        mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS, STRUCTURED)
    assert whole_run.finish_reason == "stop" and whole_run.content_chunks > KILL_AFTER_CHUNKS, whole_run
    evidence = FailoverEvidence(mesh)
    broken = mesh.stream(MAX_TOKENS, STRUCTURED, kill_one_of=HEADS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.errors == [] and broken.killed in HEADS
    evidence.check(broken.killed)
    assert broken.text == whole_run.text and broken.finish_reason == "stop"
    jsonschema.validate(json.loads(broken.text), JSON_LIST_SCHEMA)


def test_the_continued_stream_keeps_one_id_and_one_opening(mesh: FailoverMesh) -> None:
    ids: set[str] = set()
    roles = 0
    progress_keys = 0
    killed = None
    content = 0
    with httpx.stream("POST", f"{mesh.tracker.url}/v1/chat/completions",
                      json=mesh.body(MAX_TOKENS, None, True), timeout=120) as response:
        for line in response.iter_lines():
            data = parse_sse_line(line)
            if data is None or data == "[DONE]":
                continue
            event = orjson.loads(data)
            ids.add(event["id"])
            progress_keys += "meshnet" in event
            for choice in event.get("choices") or []:
                roles += choice["delta"].get("role") == "assistant"
                content += bool(choice["delta"].get("content"))
            if killed is None and content >= KILL_AFTER_CHUNKS:
                killed = mesh.serving(HEADS)
                mesh.kill(killed)
    assert killed is not None
    assert len(ids) == 1 and roles == 1 and progress_keys == 0


def test_when_no_other_head_exists_the_stream_ends_with_an_error_event(mesh: FailoverMesh) -> None:
    mesh.kill("head-b")
    broken = mesh.stream(MAX_TOKENS, kill_one_of=("head-a",), kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.killed == "head-a" and broken.done and broken.events_after_done == 0
    assert len(broken.errors) == 1 and broken.errors[0]["code"] == "head_failed"
    assert "head-a" in broken.errors[0]["message"]
    assert broken.finish_reason is None


def test_a_non_streamed_answer_outlives_its_head_and_equals_the_uninterrupted_one(mesh: FailoverMesh) -> None:
    whole_run = mesh.chat(MAX_TOKENS)
    assert whole_run.status_code == 200, whole_run.text
    before = {name: tokens_generated(mesh, name) for name in HEADS}
    killed: list[str] = []

    def kill_when_under_way() -> None:
        wait_for(lambda: any(tokens_generated(mesh, n) - before[n] >= KILL_AFTER_CHUNKS for n in HEADS),
                 "the answer to be under way", timeout_s=120)
        victim = next(n for n in HEADS if tokens_generated(mesh, n) - before[n] >= KILL_AFTER_CHUNKS)
        mesh.kill(victim)
        killed.append(victim)

    evidence = FailoverEvidence(mesh)
    killer = threading.Thread(target=kill_when_under_way)
    killer.start()
    answer = mesh.chat(MAX_TOKENS)
    killer.join()
    assert answer.status_code == 200, answer.text
    assert killed and killed[0] in HEADS
    evidence.check(killed[0])
    body, whole = answer.json(), whole_run.json()
    assert body["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"] == whole["usage"]
    assert body["object"] == "chat.completion"


CONCURRENT_STREAMS: Final = 16


def test_sixteen_streams_outlive_the_head_some_of_them_had_and_each_equals_its_solo_run(
        mesh: FailoverMesh) -> None:
    solo = mesh.stream(MAX_TOKENS)
    results, _ = mesh.streams_with_a_kill(CONCURRENT_STREAMS, MAX_TOKENS, HEADS, KILL_AFTER_CHUNKS, timeout_s=300)

    for result in results:
        assert result.errors == []
        assert result.text == solo.text
        assert (result.finish_reason, result.completion_tokens, result.done) == ("length", MAX_TOKENS, True)
