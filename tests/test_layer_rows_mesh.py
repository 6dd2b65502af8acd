"""Concurrent streams through real node processes serving a packed GGUF of an architecture held in
transformers' own layers (a dense one, gemma2, and an MoE, qwen3_moe): every stream answers exactly what
transformers ``generate`` answers for it alone, greedy and seeded, on 1 node and on 2 (split between layers 1
and 2, inside the expert layers), while the nodes batch the streams' steps (``--max-batch``, the default).

A packed shard's session gets the same bits alone or in any batch (``tests/test_layer_rows.py``), so what a
stream answers does not depend on which streams shared its steps: the comparison holds however the machine
schedules them.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from tests.gguf_mesh import SAMPLING, GgufMesh, Served, gguf_mesh, reference, serve_family

FAMILIES: Final = {"gemma2": "Q4_0", "qwen3_moe": "Q4_0"}
TOPICS: Final = ("the sea", "a cat", "bread", "an old house on a hill")
NEW_TOKENS: Final = 10


def _messages(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me about {topic}."}]


def _expected(served: Served, topic: str, sampling: dict[str, Any] | None) -> str:
    """transformers ``generate`` on the same weights, for this prompt alone."""
    prompt = served.tokenizer.apply_chat_template(_messages(topic), add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
    return served.tokenizer.decode(reference(served, sampling, NEW_TOKENS, prompt), skip_special_tokens=True)


def _ask(mesh: GgufMesh, hops: int, topic: str, sampling: dict[str, Any] | None) -> str:
    args: dict[str, Any] = {"temperature": 0}
    if sampling is not None:
        args = {"temperature": sampling["temperature"], "top_p": sampling["top_p"], "seed": sampling["seed"],
                "extra_body": {"top_k": sampling["top_k"]}}
    done = mesh.client(hops).chat.completions.create(model=mesh.model, messages=_messages(topic),
                                                     max_tokens=NEW_TOKENS, **args)
    return done.choices[0].message.content or ""


def _batched_rows(url: str) -> tuple[float, float]:
    """The node's decode turns and the rows they ran (``meshnet_node_batch_rows``' count and sum)."""
    text = httpx.get(f"{url}/metrics").text
    found = {kind: float(value) for kind, value in re.findall(
        r"^meshnet_node_batch_rows_(count|sum)(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)}
    return found.get("count", 0.0), found.get("sum", 0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_streams_each_answer_what_transformers_answers_alone(family: str, tmp_path: Path) -> None:
    served = serve_family(family, tmp_path, FAMILIES[family])
    streams = [(hops, topic, sampling) for hops in (1, 2) for topic in TOPICS for sampling in (None, SAMPLING)]
    expected = [_expected(served, topic, sampling) for _, topic, sampling in streams]
    with gguf_mesh(served) as mesh, ThreadPoolExecutor(len(streams)) as pool:
        answers = list(pool.map(lambda stream: _ask(mesh, *stream), streams))
        turns = {name: _batched_rows(node.url) for name, node in mesh.nodes.items()}
    assert answers == expected, f"decode turns and rows per node: {turns}"
