"""Failover in a four-node chain: around a dead middle node, and a clean end when nothing can replace a node.

Four node processes and a tracker (tests/failover_mesh.py): ``head`` holds
layer 0, ``mid-a`` and ``mid-b`` both hold 1-2, ``tail`` alone holds 3.

* Killing the middle node that serves a stream moves the session to the
  other one: the stream equals an uninterrupted run.
* Killing the tail, the only holder of layer 3, leaves no complete route: the
  stream ends with an OpenAI-shaped error event and ``data: [DONE]``, well
  within a bound (a hang fails the test), and a non-streamed request gets
  503, until the tail, restarted on its port, comes back into routes by itself.
"""

from __future__ import annotations

from typing import Final

from tests.failover_mesh import FailoverMesh, mesh_fixtures, wait_for

MIDDLES: Final = ("mid-a", "mid-b")
LAYERS: Final = {"head": (0, 0), "mid-a": (1, 2), "mid-b": (1, 2), "tail": (3, 3)}
MAX_TOKENS: Final = 300
KILL_AFTER_CHUNKS: Final = 20
ERROR_BOUND_S: Final = 30.0
"""A stream that lost the only holder of a range must end within this (a correctness bound, not a benchmark)."""


mesh, whole = mesh_fixtures(LAYERS)


def test_a_greedy_stream_outlives_its_middle_node_and_equals_the_uninterrupted_run(mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS)
    assert whole_run.finish_reason == "length" and whole_run.completion_tokens == MAX_TOKENS

    broken = mesh.stream(MAX_TOKENS, kill_one_of=MIDDLES, kill_after_chunks=KILL_AFTER_CHUNKS)

    assert broken.killed is not None and broken.chunks_before_kill < whole_run.content_chunks
    assert mesh.node_view()[broken.killed]["failures"] == 1, "the head met the dead middle node and reported it"
    assert broken.errors == []
    assert broken.text == whole_run.text
    assert (broken.finish_reason, broken.completion_tokens, broken.done) == ("length", MAX_TOKENS, True)
    wait_for(lambda: mesh.idle(), "the tail to free the broken session's cache as well as the new one's")


BATCHED_STREAMS: Final = 4


def test_streams_batched_together_outlive_a_middle_node_and_each_equals_the_uninterrupted_run(
        mesh: FailoverMesh) -> None:
    """Four streams share batched steps (and batched frames) on every node; a middle node dies under them."""
    whole_run = mesh.stream(MAX_TOKENS)
    results, victim = mesh.streams_with_a_kill(BATCHED_STREAMS, MAX_TOKENS, MIDDLES, KILL_AFTER_CHUNKS)

    assert mesh.node_view()[victim]["failures"] == 1, "the heads met the dead middle node and reported it"
    for result in results:
        assert result.errors == []
        assert result.text == whole_run.text
        assert (result.finish_reason, result.completion_tokens, result.done) == ("length", MAX_TOKENS, True)
    wait_for(lambda: mesh.idle(), "every session of the four streams to be closed on the survivors")


def test_when_the_only_tail_dies_streams_end_with_an_error_event_and_requests_get_503_until_it_restarts(
        mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS)

    broken = mesh.stream(MAX_TOKENS, kill_one_of=("tail",), kill_after_chunks=KILL_AFTER_CHUNKS)

    assert broken.killed == "tail"
    assert broken.seconds_from_kill_to_end is not None and broken.seconds_from_kill_to_end < ERROR_BOUND_S
    assert len(broken.errors) == 1 and broken.done and broken.events_after_done == 0
    error = broken.errors[0]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == "no_route" and error["failed_node"] == "tail" and "tail" in error["message"]
    assert broken.finish_reason is None
    assert whole_run.text.startswith(broken.text), "what arrived before the error is the true answer so far"

    refused = mesh.chat(20)
    assert refused.status_code == 503, refused.text
    assert set(refused.json()["error"]) >= {"message", "type", "code"}

    mesh.revive("tail")

    back = mesh.node_view()["tail"]
    assert (back["state"], back["failures"], back["backoff_remaining_s"]) == ("online", 0, 0)
    answer = mesh.chat(MAX_TOKENS)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == whole_run.text
