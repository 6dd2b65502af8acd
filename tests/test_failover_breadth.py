"""What a head failover must carry besides the text: ``n > 1`` choices, ``logit_bias`` and logprobs.

The harness of test_failover_head (tests/failover_mesh.py): ``head-a`` and
``head-b`` hold layers 0-1, ``tail`` 2-3. A streamed chat goes through the
tracker; after some content the test SIGKILLs the head serving it and the
tracker continues the answer on the other head. Each continued stream must
equal the uninterrupted one, choice by choice and logprob by logprob; the
request's ``logit_bias`` is shown to matter (the biased answer differs from
the unbiased one), so a continuation that dropped it would differ too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import orjson
import pytest

from meshwire.sse import parse_sse_line
from tests.failover_mesh import STREAM_TIMEOUT_S, FailoverMesh, mesh_fixtures, start_mesh

HEADS: Final = ("head-a", "head-b")
LAYERS: Final = {"head-a": (0, 1), "head-b": (0, 1), "tail": (2, 3)}
MAX_TOKENS: Final = 60
KILL_AFTER_CHUNKS: Final = 12
TOP_LOGPROBS: Final = 2
LOGPROB_TOLERANCE: Final = 1e-3
"""A replayed prompt runs in other frames than the first run's steps: float32 rounding may differ that much."""
BIASED_TOKEN: Final = "30"
"""A token id of the tiny vocabulary (``<``) the bias pushes into the answer."""
BIAS: Final = 4

mesh, whole = mesh_fixtures(LAYERS, {"MESHNET_IDLE_TIMEOUT_S": "5"})


@dataclass
class Choices:
    """A streamed answer, choice by choice: text, the logprob entries, the finish reason."""

    text: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    content_chunks: int = 0
    killed: str | None = None


def stream(mesh: FailoverMesh, body: dict[str, Any], kill: bool) -> Choices:
    """Stream ``body`` through the tracker; with ``kill``, SIGKILL the serving head after some content."""
    result = Choices()
    request = {"model": mesh.model, "messages": [{"role": "user", "content": "Tell me a long story about the river."}],
               "max_tokens": MAX_TOKENS, "stream": True, **body}
    with httpx.stream("POST", f"{mesh.tracker.url}/v1/chat/completions", json=request,
                      timeout=STREAM_TIMEOUT_S) as response:
        assert response.status_code == 200, response.read().decode()
        for line in response.iter_lines():
            data = parse_sse_line(line)
            if data is None or data == "[DONE]":
                continue
            event = orjson.loads(data)
            if "error" in event:
                result.errors.append(event["error"])
                continue
            for choice in event.get("choices") or []:
                index = choice["index"]
                if content := choice["delta"].get("content"):
                    result.text[index] = result.text.get(index, "") + content
                    result.content_chunks += 1
                if choice.get("logprobs") and choice["logprobs"].get("content"):
                    result.logprobs.setdefault(index, []).extend(choice["logprobs"]["content"])
                if choice.get("finish_reason"):
                    result.finish[index] = choice["finish_reason"]
            if kill and result.killed is None and result.content_chunks >= KILL_AFTER_CHUNKS:
                result.killed = mesh.serving(HEADS)
                mesh.kill(result.killed)
    return result


def assert_same_logprobs(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [entry["token"] for entry in got] == [entry["token"] for entry in want]
    for mine, theirs in zip(got, want, strict=True):
        assert math.isclose(mine["logprob"], theirs["logprob"], abs_tol=LOGPROB_TOLERANCE), (mine, theirs)
        assert [top["token"] for top in mine["top_logprobs"]] == [top["token"] for top in theirs["top_logprobs"]]


def test_logit_bias_and_logprobs_go_on_across_a_head_failover(mesh: FailoverMesh) -> None:
    body = {"temperature": 0, "logit_bias": {BIASED_TOKEN: BIAS}, "logprobs": True, "top_logprobs": TOP_LOGPROBS}
    plain = stream(mesh, {"temperature": 0}, kill=False)
    whole_run = stream(mesh, body, kill=False)
    assert whole_run.text[0] != plain.text[0], "the bias changes the answer, so losing it would show"
    assert len(whole_run.logprobs[0]) == MAX_TOKENS

    broken = stream(mesh, body, kill=True)

    assert broken.killed in HEADS and broken.errors == []
    assert broken.text == whole_run.text and broken.finish == whole_run.finish == {0: "length"}
    assert_same_logprobs(broken.logprobs[0], whole_run.logprobs[0])


def test_n_seeded_choices_go_on_across_a_head_failover(mesh: FailoverMesh) -> None:
    body = {"n": 2, "temperature": 0.8, "seed": 3}
    whole_run = stream(mesh, body, kill=False)
    assert set(whole_run.text) == {0, 1} and whole_run.text[0] != whole_run.text[1]

    broken = stream(mesh, body, kill=True)

    assert broken.killed in HEADS and broken.errors == []
    assert broken.text == whole_run.text
    assert broken.finish == whole_run.finish and set(broken.finish) == {0, 1}


@pytest.mark.parametrize(("setting", "value", "says"), [
    ("MESHNET_CONTINUE_ATTEMPTS", "0", "within 0 attempts"),
    # Any failover comes later than a millisecond after the stream began (it waited for content first).
    ("MESHNET_CONTINUE_DEADLINE_S", "0.001", "within the 0.001 s deadline"),
])
def test_a_tracker_told_not_to_continue_ends_the_stream_with_an_error_though_another_head_is_up(
        tiny_model_dir: Path, setting: str, value: str, says: str) -> None:
    """``MESHNET_CONTINUE_ATTEMPTS=0`` (no new head tried) and a deadline already past when the head dies:
    either way the stream ends with one ``head_failed`` error event and ``[DONE]``, although ``head-b``, the
    other head, is up and was never asked."""
    limited = start_mesh(tiny_model_dir, LAYERS, {"MESHNET_IDLE_TIMEOUT_S": "5"}, {setting: value})
    try:
        broken = limited.stream(MAX_TOKENS, kill_one_of=HEADS, kill_after_chunks=KILL_AFTER_CHUNKS)
        assert broken.killed in HEADS and broken.done and broken.events_after_done == 0
        assert len(broken.errors) == 1 and broken.errors[0]["code"] == "head_failed", broken.errors
        assert broken.killed in broken.errors[0]["message"] and says in broken.errors[0]["message"], broken.errors
        assert broken.finish_reason is None
        survivor = next(name for name in HEADS if name != broken.killed)
        assert "continues on" not in limited.tracker.log()
        assert limited.nodes[survivor].alive()
    finally:
        limited.stop()
