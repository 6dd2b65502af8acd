"""``n > 1`` from one prefill (``meshwire.fork``): the choices share their prompt's KV and still equal
``n`` separate seeded requests, token for token.

A real tracker and two nodes splitting the tiny model in float32; the official client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import Service, start_service, wait_healthy
from tests.tiny_mesh import HEARTBEAT_S, wait_until_servable

PROMPT: Final = [{"role": "user", "content": "Where does the river run, and why?"}]
NODES: Final = (("front-node", "0-1"), ("back-node", "2-3"))
N: Final = 3


class Mesh:
    def __init__(self, tracker: Service, nodes: dict[str, Service], model: str) -> None:
        self.tracker, self.nodes, self.model = tracker, nodes, model
        self.client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def metric(self, node: str, sample: str, **labels: str) -> float:
        total = 0.0
        for family in text_string_to_metric_families(httpx.get(f"{self.nodes[node].url}/metrics").text):
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += float(s.value)
        return total

    def counts(self) -> dict[str, tuple[float, float, float]]:
        """Per node: positions computed, positions copied by forks, forks refused."""
        return {name: (self.metric(name, "meshnet_node_positions_computed_total"),
                       self.metric(name, "meshnet_node_fork_positions_total"),
                       self.metric(name, "meshnet_node_forks_total", outcome="refused")) for name in self.nodes}


@contextlib.contextmanager
def started_mesh(model_dir: Path, speculate: str) -> Iterator[Mesh]:
    tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_STORE": "memory"})
    nodes: dict[str, Service] = {}
    try:
        for node_id, layers in NODES:
            nodes[node_id] = start_service("node", {
                "MESHNET_MODEL": str(model_dir), "MESHNET_LAYERS": layers, "MESHNET_TRACKER": tracker.url,
                "MESHNET_NODE_ID": node_id, "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
                "MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_SPECULATE": speculate}, wait_ready=False)
        for node in nodes.values():
            wait_healthy(node)
        yield Mesh(tracker, nodes, wait_until_servable(tracker, model_dir.name))
    finally:
        for service in [*nodes.values(), tracker]:
            service.stop()


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[Mesh]:
    with started_mesh(tiny_model_dir, "off") as running:
        yield running


@pytest.fixture(scope="module")
def speculating(tiny_model_dir: Path) -> Iterator[Mesh]:
    with started_mesh(tiny_model_dir, "on") as running:
        yield running


def chat(mesh: Mesh, **extra: Any) -> Any:
    return mesh.client.chat.completions.create(model=mesh.model, messages=PROMPT, **{"max_tokens": 8, **extra})


def streamed_texts(chunks: list[Any], n: int, *, chat_api: bool) -> list[str]:
    texts = [""] * n
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if chat_api else choice.text
    return texts


def test_n_seeded_chat_choices_equal_separate_requests_and_the_prompt_runs_once(mesh: Mesh) -> None:
    before = mesh.counts()
    several = chat(mesh, n=N, temperature=0.9, seed=5, logprobs=True)
    middle = mesh.counts()
    singles = [chat(mesh, temperature=0.9, seed=5 + index, logprobs=True) for index in range(N)]
    after = mesh.counts()
    assert [c.message.content for c in several.choices] == [s.choices[0].message.content for s in singles]
    assert [[t.token for t in c.logprobs.content] for c in several.choices] == \
        [[t.token for t in s.choices[0].logprobs.content] for s in singles]
    assert len({c.message.content for c in several.choices}) > 1, "each choice draws its own tokens"
    prompt = several.usage.prompt_tokens
    for name in mesh.nodes:
        forked = middle[name][0] - before[name][0]
        alone = after[name][0] - middle[name][0]
        copied = middle[name][1] - before[name][1]
        assert middle[name][2] == before[name][2], f"{name} refused no fork"
        assert copied == (N - 1) * (prompt - 1), f"{name} copied the prompt's rows for every follower"
        assert forked == alone - (N - 1) * (prompt - 1), f"{name} ran the prompt once, one position per follower"


def test_n_streamed_chat_and_completions_equal_separate_requests(mesh: Mesh) -> None:
    chunks = list(chat(mesh, n=N, temperature=0.8, seed=11, stream=True))
    singles = [chat(mesh, temperature=0.8, seed=11 + index).choices[0].message.content for index in range(N)]
    assert streamed_texts(chunks, N, chat_api=True) == singles
    kwargs: dict[str, Any] = {"model": mesh.model, "prompt": "The river runs to the sea because", "max_tokens": 8,
                              "temperature": 0.9}
    answer = mesh.client.completions.create(n=N, seed=3, **kwargs)
    streamed = list(mesh.client.completions.create(n=N, seed=3, stream=True, **kwargs))
    alone = [mesh.client.completions.create(seed=3 + index, **kwargs).choices[0].text for index in range(N)]
    assert [choice.text for choice in answer.choices] == alone
    assert streamed_texts(streamed, N, chat_api=False) == alone


def test_n_greedy_choices_with_structured_output_equal_one_answer(mesh: Mesh) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"river": {"type": "string"}}, "required": ["river"]}}}
    several = chat(mesh, n=N, temperature=0.7, seed=2, response_format=fmt)
    singles = [chat(mesh, temperature=0.7, seed=2 + i, response_format=fmt) for i in range(N)]
    assert [c.message.content for c in several.choices] == [s.choices[0].message.content for s in singles]


def test_a_fork_whose_source_is_gone_falls_back_to_a_prefill_and_still_equals(mesh: Mesh) -> None:
    """``max_tokens=1``: the first choice ends (and closes its session) as soon as its prompt is in, so the
    others' forks may find it gone at the head or on a hop; whichever way, every choice equals its request."""
    def outcomes() -> float:
        return sum(mesh.metric("front-node", "meshnet_node_forks_total", outcome=o) for o in ("forked", "refused"))

    before = outcomes()
    for seed in range(4):
        several = mesh.client.chat.completions.create(model=mesh.model, messages=PROMPT, max_tokens=1, n=N,
                                          temperature=0.9, seed=seed)
        singles = [mesh.client.chat.completions.create(model=mesh.model, messages=PROMPT, max_tokens=1,
                                                       temperature=0.9, seed=seed + i) for i in range(N)]
        assert [c.message.content for c in several.choices] == [s.choices[0].message.content for s in singles]
    assert outcomes() - before == 4 * (N - 1), "every follower forked or fell back to a prefill"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_with_speculation_on_the_choices_still_equal_separate_requests(speculating: Mesh,
                                                                      temperature: float) -> None:
    before = speculating.counts()
    several = chat(speculating, n=N, temperature=temperature, seed=7, max_tokens=12)
    copied = {name: speculating.counts()[name][1] - before[name][1] for name in speculating.nodes}
    singles = [chat(speculating, temperature=temperature, seed=7 + i, max_tokens=12) for i in range(N)]
    assert [c.message.content for c in several.choices] == [s.choices[0].message.content for s in singles]
    assert all(value == (N - 1) * (several.usage.prompt_tokens - 1) for value in copied.values()), copied
