"""A shadow of a hop before the tail stays in step with it through speculative steps (issue 37).

A shadow runs every frame the hop it shadows runs, in its own session, so that the tracker can compare their
receipts. On a speculative step a hop before the tail learns which drafted positions the tail kept only from the
answer passing back, and drops the KV rows of the others; its shadow sends nothing on and gets no such answer. It
learns it from the next frame instead, whose offset starts where the kept run ended. Without that, a shadow of a
middle hop refused every frame after the first rejected draft (409 ``bad_position``), and the hop was no longer
checked for the rest of the session.

Nodes without a tracker (pinned keys), a route the test signs: a head (layers 0-1, speculating whenever prompt
lookup has a draft), ``mid`` (layer 2) shadowed by ``mid_shadow``, a tail (layer 3), float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import httpx
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire import headers as h
from meshwire.auth import bearer_headers
from meshwire.routes import Route, RouteNode, ShadowHop, plan_start_layers, sign_route
from tests.procs import TEST_ROUTE_KEY, TEST_SECRET, Service, named_nodes, node_hop_key

LAYERS: Final = {"head": (0, 1), "mid": (2, 2), "mid_shadow": (2, 2), "tail": (3, 3)}
PROMPT: Final = [{"role": "user", "content": "one two three four one two three four one two three four one two"}]
MAX_TOKENS: Final = 24
TIMEOUT_S: Final = 120.0


def _metric(node: Service, name: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{node.url}/metrics", timeout=30).text)
    return sum(sample.value for family in families for sample in family.samples if sample.name == name)


def _hop(nodes: dict[str, Service], name: str, start_layer: int | None = None) -> RouteNode:
    start, end = LAYERS[name]
    return RouteNode(node_id=name, endpoint=nodes[name].url, shard_start=start, shard_end=end,
                     start_layer=start if start_layer is None else start_layer, hop_key=node_hop_key(name).public_text)


def test_a_shadow_of_a_middle_hop_stays_in_step_through_rejected_drafts(
        tiny_model_dir: Path, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    common = {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
              "MESHNET_THREADS": "1"}
    with named_nodes(LAYERS, common, {"head": {"MESHNET_SPECULATE": "on"}}) as nodes:
        model = httpx.get(f"{nodes['head'].url}/health", timeout=30).json()["model"]
        hops = plan_start_layers([_hop(nodes, name) for name in ("head", "mid", "tail")])
        route = Route(model=model, nodes=hops, num_layers=4,
                      shadow=ShadowHop(hop_index=1, node=_hop(nodes, "mid_shadow")))
        answer = httpx.post(f"{nodes['head'].url}/v1/chat/completions", timeout=TIMEOUT_S,
                            headers={h.ROUTE: sign_route(route, TEST_ROUTE_KEY), **bearer_headers(TEST_SECRET)},
                            json={"model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert answer.status_code == 200, answer.text
        inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        out = reference.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
        expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:].tolist(), skip_special_tokens=True)
        assert answer.json()["choices"][0]["message"]["content"] == expected
        head, mid, shadow = nodes["head"], nodes["mid"], nodes["mid_shadow"]
        drafted = _metric(head, "meshnet_node_drafted_tokens_total")
        assert drafted > _metric(head, "meshnet_node_accepted_tokens_total"), "some drafts were rejected"
        assert _metric(shadow, "meshnet_node_frames_refused_total") == 0
        assert _metric(shadow, "meshnet_node_positions_computed_total") == _metric(
            mid, "meshnet_node_positions_computed_total"), "the shadow ran every frame the hop ran"
