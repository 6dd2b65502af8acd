"""Beyond exact answers, per architecture: a dense family beyond Llama (qwen3: per-head q/k norms) and an MoE
(qwen3_moe: router, top-k experts), each a tiny Q4_0 GGUF held packed (``tests/test_gguf_packed.py``).

A tracker and three node processes per family (``tests/failover_mesh.py``): ``head`` holds layers 0-1 and
drafts by prompt lookup (``MESHNET_SPECULATE=on``), ``tail-a`` and ``tail-b`` both hold 2-3. What must hold:

* a greedy stream with speculation answers what transformers ``generate`` does on the same weights (so
  speculation changes nothing), and so does the same stream when the tail serving it is SIGKILLed mid-way
  (the head replays the session through the other tail: its KV caches, experts' included, rebuilt);
* a structured output (seeded sampling under a JSON schema) that loses its tail mid-way is the same answer
  as the uninterrupted one, and follows the schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Final

import httpx
import jsonschema
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.failover_mesh import JSON_LIST_SCHEMA, LONG_PROMPT, STRUCTURED, FailoverMesh, start_mesh
from tests.gguf_mesh import Served, serve_family

FAMILIES: Final = ("qwen3", "qwen3_moe")
QUANT: Final = "Q4_0"
LAYERS: Final = {"head": (0, 1), "tail-a": (2, 3), "tail-b": (2, 3)}
TAILS: Final = ("tail-a", "tail-b")
MAX_TOKENS: Final = 48
"""The tiny models do not end their answer to :data:`LONG_PROMPT` within this many tokens (checked below)."""
STRUCTURED_MAX_TOKENS: Final = 200
KILL_AFTER_CHUNKS: Final = 10


@pytest.fixture(scope="module", params=FAMILIES)
def family_mesh(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, FailoverMesh]]:
    served = serve_family(request.param, tmp_path_factory.mktemp(request.param), QUANT)
    mesh = start_mesh(served.gguf.path, LAYERS, node_env={"MESHNET_MODEL_CACHE_DIR": str(served.cache),
                                                          "MESHNET_SPECULATE": "on"})
    try:
        yield served, mesh
    finally:
        mesh.stop()


@pytest.fixture(autouse=True)
def whole(family_mesh: tuple[Served, FailoverMesh]) -> Iterator[None]:
    """Every node alive again after each test, so one test's kill never reaches the next."""
    yield
    family_mesh[1].revive_all()


def _expected(served: Served) -> str:
    """transformers' greedy answer to :data:`LONG_PROMPT` on the same weights, :data:`MAX_TOKENS` long."""
    prompt = served.tokenizer.apply_chat_template(LONG_PROMPT, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
    out = served.gguf.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
                                     do_sample=False, pad_token_id=served.gguf.model.config.pad_token_id)
    tokens = out[0, prompt.shape[1]:].tolist()
    assert len(tokens) == MAX_TOKENS, "the reference ended early: the kill could miss the stream"
    return served.tokenizer.decode(tokens, skip_special_tokens=True)


def _drafted(mesh: FailoverMesh) -> float:
    text = httpx.get(f"{mesh.nodes['head'].url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "meshnet_node_drafted_tokens_total")


def test_a_greedy_stream_with_speculation_outlives_its_tail_and_answers_as_transformers(
        family_mesh: tuple[Served, FailoverMesh]) -> None:
    served, mesh = family_mesh
    expected = _expected(served)
    drafted = _drafted(mesh)
    whole_run = mesh.stream(MAX_TOKENS)
    assert (whole_run.text, whole_run.completion_tokens, whole_run.errors) == (expected, MAX_TOKENS, [])
    assert _drafted(mesh) > drafted, "the head drafted tokens: speculation ran"

    broken = mesh.stream(MAX_TOKENS, kill_one_of=TAILS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.killed is not None and broken.chunks_before_kill < whole_run.content_chunks
    assert broken.errors == []
    assert (broken.text, broken.finish_reason, broken.completion_tokens) == (expected, "length", MAX_TOKENS)


def test_a_structured_output_outlives_its_tail_as_the_same_answer(family_mesh: tuple[Served, FailoverMesh]) -> None:
    _, mesh = family_mesh
    whole_run = mesh.stream(STRUCTURED_MAX_TOKENS, STRUCTURED)
    assert whole_run.finish_reason == "stop" and whole_run.content_chunks > KILL_AFTER_CHUNKS, whole_run
    jsonschema.validate(json.loads(whole_run.text), JSON_LIST_SCHEMA)
    broken = mesh.stream(STRUCTURED_MAX_TOKENS, STRUCTURED, kill_one_of=TAILS, kill_after_chunks=KILL_AFTER_CHUNKS)
    assert broken.killed is not None and broken.errors == []
    assert (broken.text, broken.finish_reason) == (whole_run.text, "stop")
