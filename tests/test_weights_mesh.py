"""A mesh mixing weight formats: an ``int4`` node heading a ``float`` node, as real processes.

``quant`` holds layers 0-1 of the tiny model with ``MESHNET_WEIGHTS=int4``,
``float`` holds layers 2-3 as float32. The route ``quant -> float`` answers
what the same two shards chained in this process answer, token for token
(the hops add nothing to the arithmetic). Both nodes register with a
recording stand-in for the tracker, so the test reads exactly what each node
posts: its weight format and the bytes its weights and KV cache take, which
``/metrics`` shows too.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, GenerationConfig

from meshwire import headers as h
from meshwire.limits import ROUTE_TTL_S
from meshwire.registry import NodeRegistration
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from services.node.model.shard_load import load_shard
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    free_port,
    node_hop_key,
    pinned_node_env,
    start_service,
    wait_healthy,
)

LAYERS = {"quant": (0, 1), "float": (2, 3)}
WEIGHTS = {"quant": "int4", "float": "float"}
NUM_LAYERS = 4
MAX_TOKENS = 12
WAIT_S = 30.0
HEARTBEAT_S = 0.3
PROMPTS = (
    [{"role": "user", "content": "Where does the river run before it reaches the sea?"}],
    [{"role": "user", "content": "Hello"}],
)


class RecordingTracker(ThreadingHTTPServer):
    """Answers registrations like the tracker and keeps the last body each node posted."""

    def __init__(self) -> None:
        self.bodies: dict[str, dict[str, Any]] = {}
        super().__init__(("127.0.0.1", free_port()), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: RecordingTracker

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies[body["node_id"]] = body
        self._answer({"lease": f"lease-{body['node_id']}", "heartbeat_s": HEARTBEAT_S, "ttl_s": 10.0})

    def do_DELETE(self) -> None:
        self._answer({})

    def _answer(self, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class MixedMesh:
    nodes: dict[str, Service]
    tracker: RecordingTracker
    model: str

    def client(self) -> openai.OpenAI:
        hops = [RouteNode(node_id=name, endpoint=self.nodes[name].url, shard_start=a, shard_end=b, start_layer=a,
                          hop_key=node_hop_key(name).public_text) for name, (a, b) in LAYERS.items()]
        token = sign_route(Route(model=self.model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS),
                           TEST_ROUTE_KEY, ttl_s=ROUTE_TTL_S)
        return openai.OpenAI(base_url=f"{self.nodes['quant'].url}/v1", api_key=TEST_SECRET, max_retries=0,
                             timeout=120, default_headers={h.ROUTE: token})

    def registration(self, name: str) -> NodeRegistration:
        deadline = time.monotonic() + WAIT_S
        while name not in self.tracker.bodies:
            assert time.monotonic() < deadline, f"{name} never registered"
            time.sleep(0.05)
        return NodeRegistration.model_validate(self.tracker.bodies[name])


@pytest.fixture(scope="module")
def mixed(tiny_model_dir: Path) -> Iterator[MixedMesh]:
    tracker = RecordingTracker()
    thread = threading.Thread(target=tracker.serve_forever, daemon=True)
    thread.start()
    nodes: dict[str, Service] = {}
    try:
        for name, (start, end) in LAYERS.items():
            nodes[name] = start_service("node", {
                "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
                "MESHNET_WEIGHTS": WEIGHTS[name], "MESHNET_NODE_ID": name, "MESHNET_LAYERS": f"{start}-{end}",
                "MESHNET_TRACKER": tracker.url, "MESHNET_HEARTBEAT_S": str(HEARTBEAT_S), **pinned_node_env(name)},
                wait_ready=False)
        for service in nodes.values():
            wait_healthy(service)
        yield MixedMesh(nodes, tracker, httpx.get(f"{nodes['quant'].url}/health").json()["model"])
    finally:
        for service in nodes.values():
            service.stop()
        tracker.shutdown()
        tracker.server_close()


def in_process_answer(folder: Path, messages: list[dict[str, str]]) -> str:
    """What the same two shards answer greedily, chained in this process."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    stops = GenerationConfig.from_pretrained(folder).eos_token_id
    stops = {stops} if isinstance(stops, int) else set(stops or ())
    head = load_shard(folder, 0, 1, torch.float32, torch.device("cpu"), weights="int4")
    tail = load_shard(folder, 2, 3, torch.float32, torch.device("cpu"))
    caches = head.new_cache(), tail.new_cache()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    new: list[int] = []
    while len(new) < MAX_TOKENS:
        offset = caches[0].seq_len
        hidden = head.run_layers(head.embed(ids), caches[0], offset)
        token = int(tail.logits_last(tail.run_layers(hidden, caches[1], offset)).argmax())
        if token in stops:
            break
        new.append(token)
        ids = torch.tensor([[token]])
    return tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_an_int4_node_heading_a_float_node_answers_what_the_same_shards_answer(
        mixed: MixedMesh, tiny_model_dir: Path, prompt: int) -> None:
    answer = mixed.client().chat.completions.create(model=mixed.model, messages=PROMPTS[prompt],
                                                    max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].message.content == in_process_answer(tiny_model_dir, PROMPTS[prompt])


def test_each_node_registers_its_weight_format_and_the_bytes_its_weights_and_kv_cache_take(
        mixed: MixedMesh) -> None:
    quant, whole = mixed.registration("quant"), mixed.registration("float")
    assert (quant.weights, whole.weights) == ("int4", "float")
    assert 0 < quant.weight_bytes < whole.weight_bytes  # two packed layers and an int8 embedding, against float32


def test_the_kv_bytes_a_node_reports_return_to_zero_once_its_sessions_close(mixed: MixedMesh) -> None:
    """After a chat every hop closes its session: the heartbeat's ``kv_bytes`` and the gauge go back to 0 (a
    cache that leaked, or a figure that counts something else, keeps them above it)."""
    mixed.client().chat.completions.create(model=mixed.model, messages=PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0)

    def kv_gauge(name: str) -> float:
        text = httpx.get(f"{mixed.nodes[name].url}/metrics", timeout=WAIT_S).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        (sample,) = families["meshnet_node_kv_bytes"].samples
        return sample.value

    deadline = time.monotonic() + WAIT_S
    while any(kv_gauge(name) != 0 or mixed.registration(name).kv_bytes != 0 for name in LAYERS):
        assert time.monotonic() < deadline, {name: (kv_gauge(name), mixed.registration(name).kv_bytes)
                                             for name in LAYERS}
        time.sleep(0.1)


def test_metrics_show_the_registered_weight_bytes(mixed: MixedMesh) -> None:
    for name in LAYERS:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{mixed.nodes[name].url}/metrics").text)}
        (sample,) = families["meshnet_node_weight_bytes"].samples
        assert sample.value == mixed.registration(name).weight_bytes
        assert "meshnet_node_kv_bytes" in families
