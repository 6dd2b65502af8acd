"""Failover mid-stream while the head speculates: the stream equals its uninterrupted run.

The chain of ``tests/test_failover_chain.py`` (``head`` 0, ``mid-a`` and
``mid-b`` 1-2, ``tail`` 3), every node with ``MESHNET_SPECULATE=on``: the head
drafts along the route (the tiny model's drafts are rejected, so every step
also drops rows on every hop). Killing the middle node that serves a stream
moves the session to the other one, replaying only the tokens the client has
(never a draft), and the text equals the uninterrupted run's.
"""

from __future__ import annotations

from typing import Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.failover_mesh import FailoverMesh, mesh_fixtures, wait_for

MIDDLES: Final = ("mid-a", "mid-b")
LAYERS: Final = {"head": (0, 0), "mid-a": (1, 2), "mid-b": (1, 2), "tail": (3, 3)}
MAX_TOKENS: Final = 120
KILL_AFTER_CHUNKS: Final = 20

mesh, whole = mesh_fixtures(LAYERS, {"MESHNET_SPECULATE": "on"})


def _drafted(mesh: FailoverMesh) -> float:
    text = httpx.get(f"{mesh.nodes['head'].url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshnet_node_drafted_tokens_total":
                return float(sample.value)
    return 0.0


def test_a_speculating_greedy_stream_outlives_its_middle_node_and_equals_the_uninterrupted_run(
        mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS)
    assert whole_run.finish_reason == "length" and whole_run.completion_tokens == MAX_TOKENS
    assert _drafted(mesh) > 0

    broken = mesh.stream(MAX_TOKENS, kill_one_of=MIDDLES, kill_after_chunks=KILL_AFTER_CHUNKS)

    assert broken.killed is not None and broken.chunks_before_kill < whole_run.content_chunks
    assert broken.errors == []
    assert broken.text == whole_run.text
    assert (broken.finish_reason, broken.completion_tokens, broken.done) == ("length", MAX_TOKENS, True)
    wait_for(lambda: mesh.idle(), "every hop to free the broken session's cache as well as the new one's")
