"""A streamed tool call survives the death of its head: the new head's grammar and parser go on from the history.

The harness of tests/test_failover_head.py (``head-a`` and ``head-b`` hold
layers 0-1, ``tail`` 2-3), on a copy of the tiny model whose chat template
renders tools. After some argument pieces the test SIGKILLs the serving
head; the tracker sends the request with the tokens so far to the other
head, which replays them into the grammar and into its tool call parser, and
streams only what follows: the client gets one call, with one id, whose
arguments equal the uninterrupted run's and validate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

import jsonschema
import pytest

from tests.failover_mesh import FailoverMesh, mesh_fixtures
from tests.tiny_model import build_tool_model

HEADS: Final = ("head-a", "head-b")
LAYERS: Final = {"head-a": (0, 1), "head-b": (0, 1), "tail": (2, 3)}
MAX_TOKENS: Final = 200
KILL_AFTER_CHUNKS: Final = 15
WORDS: Final = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 6},
                             "minItems": 12, "maxItems": 12}},
    "required": ["words"],
    "additionalProperties": False,
}
"""Arguments long enough to kill a head in (at least 36 pieces) that end well within :data:`MAX_TOKENS`."""
SAMPLING: Final = {"temperature": 0.8, "seed": 5, "tool_choice": "required", "parallel_tool_calls": False,
                   "tools": [{"type": "function", "function": {"name": "list_words", "parameters": WORDS}}]}


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a tool-capable chat template, for this module's mesh."""
    return build_tool_model(tiny_model_dir, tmp_path_factory.mktemp("tools") / "tiny-tools")


mesh, whole = mesh_fixtures(LAYERS, {"MESHNET_IDLE_TIMEOUT_S": "5"})


def calls(result: Any) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"]) for call in result.tool_calls.result() or ()]


def test_a_streamed_tool_call_outlives_its_head_and_equals_the_uninterrupted_one(mesh: FailoverMesh) -> None:
    whole_run = mesh.stream(MAX_TOKENS, SAMPLING)
    assert whole_run.finish_reason == "tool_calls" and whole_run.content_chunks > KILL_AFTER_CHUNKS, whole_run
    broken = mesh.stream(MAX_TOKENS, SAMPLING, kill_one_of=HEADS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.errors == [] and broken.killed in HEADS
    assert broken.chunks_before_kill < whole_run.content_chunks
    assert (broken.text, calls(broken), broken.finish_reason) == ("", calls(whole_run), "tool_calls")
    assert len(broken.tool_calls.result() or ()) == 1 and broken.tool_calls.result()[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls(broken)[0][1]), WORDS)
