"""Speculation on the default model (SmolLM2-135M, float32, 2 nodes): greedy output unchanged, drafts accepted.

The tiny model of the other tests never repeats itself, so its drafts are all
rejected; the default model copies, which exercises accepted drafts along a
real route. Two heads (layers 0-14), one with ``MESHNET_SPECULATE=on`` and one
with ``off``, share a tail (15-29); their greedy answers to a prompt that
copies code must be equal token for token, and the speculating head's tail
must have accepted drafts. One slow test: the default model is loaded three times.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshwire import headers as h
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from services.node.model.model_source import resolve_model
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    node_hop_key,
    pinned_node_env,
    start_service,
    wait_healthy,
)

LAYERS = {"spec": (0, 14), "plain": (0, 14), "back": (15, 29)}
NUM_LAYERS = 30
CODE_PROMPT = [{"role": "user", "content": "Repeat this code exactly, but rename total to grand_total:\n\n"
                                           "def total(items):\n    result = 0\n    for item in items:\n"
                                           "        result += item.price * item.count\n    return result\n"}]


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Service]]:
    folder = resolve_model("default").path
    common = {"MESHNET_MODEL": str(folder), "MESHNET_DTYPE": "float32", "MESHNET_WEIGHTS": "float",
              "MESHNET_DEVICE": "cpu"}
    modes = {"spec": "on", "plain": "off", "back": "off"}
    started: dict[str, Service] = {}
    try:
        for name, (start, end) in LAYERS.items():
            started[name] = start_service("node", {**common, **pinned_node_env(name), "MESHNET_NODE_ID": name,
                                                   "MESHNET_LAYERS": f"{start}-{end}",
                                                   "MESHNET_SPECULATE": modes[name]}, wait_ready=False)
        for service in started.values():
            wait_healthy(service, 300.0)
        yield started
    finally:
        for service in started.values():
            service.stop()


def _metric(service: Service, sample: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{service.url}/metrics").text):
        for found in family.samples:
            if found.name == sample:
                return float(found.value)
    return 0.0


def test_greedy_output_with_speculation_equals_output_without_on_the_default_model(
        nodes: dict[str, Service]) -> None:
    model = str(httpx.get(f"{nodes['spec'].url}/health").json()["model"])
    answers = {}
    for head in ("spec", "plain"):
        hops = [RouteNode(node_id=name, endpoint=nodes[name].url, shard_start=LAYERS[name][0],
                          shard_end=LAYERS[name][1], start_layer=LAYERS[name][0],
                          hop_key=node_hop_key(name).public_text) for name in (head, "back")]
        token = sign_route(Route(model=model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS), TEST_ROUTE_KEY)
        client = openai.OpenAI(base_url=f"{nodes[head].url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=300,
                               default_headers={h.ROUTE: token})
        answer = client.chat.completions.create(model=model, messages=CODE_PROMPT, max_tokens=64, temperature=0)
        answers[head] = (answer.choices[0].message.content, answer.usage.completion_tokens)
    assert answers["spec"] == answers["plain"]
    assert _metric(nodes["spec"], "meshnet_node_accepted_tokens_total") > 0
    assert _metric(nodes["plain"], "meshnet_node_drafted_tokens_total") == 0
