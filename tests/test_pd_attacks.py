"""Sitting in the middle of a KV handoff fails: the decode side takes KV only from the node the signed route names.

The attack of issue 34, finding 1: point the bootstrap registry's prefill slot
at a listener, capture the decode node's pull (or answer it with KV of one's
own). Here a real decode node (``--role decode``, layers 2-3 of the tiny
model) is handed a handoff whose signed prefill route names a prefill node
``fakep`` that the test plays, while the bootstrap registry names a trap
listener for the same rank. What must hold:

- the decode node never dials the registry's address (the trap hears nothing);
  it pulls from the endpoint the signed route names, naming ``fakep`` in the
  pull;
- an answer that is unsigned, signed with another key, signed by ``fakep``
  for another pull (an old answer replayed), or not sealed to the pull's own
  key (``meshwire.kv_box``) is refused: the step is answered 409
  ``handoff_failed`` and the KV is not used;
- only ``fakep``'s own signature over this very pull is taken (the control that
  shows the refusals are the signature's doing).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

import httpx
import orjson
import pytest
import torch

from meshwire import headers as h
from meshwire.frames import encode_frame
from meshwire.kv_box import BOX, seal
from meshwire.kv_handoff import (
    HANDOFF_FROM,
    HANDOFF_ROUTE,
    KV_CHUNK_POSITIONS,
    KV_LAYERS,
    KV_POSITIONS,
    KV_SOURCE,
    PULL_PATH,
    KVShape,
    cache_layout,
    layout_wire,
    sign_pull_answer,
    stage_placement,
)
from meshwire.rank_proof import sign_registration
from meshwire.route_keys import SigningKey
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from tests.procs import TEST_ROUTE_KEY, TEST_SECRET, Service, node_hop_key, pinned_node_env, start_service

HIDDEN: Final = 64
POSITIONS: Final = 16
GREEDY: Final = '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}'
FAKE_KEY: Final = SigningKey.generate()
"""The hop key of the prefill node ``fakep`` the signed prefill route names (the test plays it)."""


class FakePrefill:
    """``fakep``: answers each pull with a KV chunk of zeros, signed as ``mode`` says; remembers the pulls."""

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.mode = "good"
        self.pulls: list[dict[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                headers = {name: value for name, value in self.headers.items()}
                owner.pulls.append(headers)
                status, out, body = owner.answer(self.path, headers)
                self.send_response(status)
                for name, value in out.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        if path != PULL_PATH:
            return 404, {}, b""
        first, last = (int(part) for part in headers[KV_LAYERS].split("-"))
        kv = torch.zeros((2 * (last - first + 1), self.shape.kv_heads, POSITIONS, self.shape.head_dim))
        out, body = encode_frame(kv, session=headers[h.SESSION], chunk_index=0, chunk_total=1,
                                 extra={KV_POSITIONS: str(POSITIONS), KV_LAYERS: headers[KV_LAYERS]})
        requester, proof = headers["X-Meshnet-Signer"], headers["X-Meshnet-Proof"]
        if self.mode != "not_sealed":  # sealed to the pull's own key, as a prefill node does
            out[BOX], body = seal(headers[BOX], body, proof)
        if self.mode == "other_key":
            out.update(sign_pull_answer(SigningKey.generate(), "fakep", out, body, requester=requester,
                                        request_proof=proof))
        elif self.mode == "replayed":  # fakep's genuine answer to an earlier pull
            out.update(sign_pull_answer(FAKE_KEY, "fakep", out, body, requester=requester,
                                        request_proof=f"{int(time.time() * 1000) - 5000}.{'A' * 86}"))
        elif self.mode in ("good", "not_sealed"):
            out.update(sign_pull_answer(FAKE_KEY, "fakep", out, body, requester=requester, request_proof=proof))
        return 200, out, body

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def model_shape(tiny_model_dir: Path) -> KVShape:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return KVShape(num_layers=int(config["num_hidden_layers"]), kv_heads=kv_heads,
                   head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
                   dtype="float32", itemsize=4, max_positions=int(config["max_position_embeddings"]))


@pytest.fixture(scope="module")
def trap() -> Iterator[socket.socket]:
    """The attacker's listener the bootstrap registry names for the prefill rank."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def bootstrap(model_shape: KVShape, trap: socket.socket) -> Iterator[Service]:
    with start_service("bootstrap", {"MESHNET_REGISTRY": "cache-layouts"}) as service:
        registration = orjson.dumps({
            "role": "Prefill", "world_size": 1, "dp_size": 1, "rank_ip": "127.0.0.1",
            "rank_port": trap.getsockname()[1], "engine_rank": 0, "pp_size": 1,
            "cache_layout": layout_wire(cache_layout(model_shape)),
            "cache_fields_by_stage": stage_placement([(0, model_shape.num_layers - 1)])})
        answer = httpx.put(f"{service.url}/route", content=registration,
                           headers={"content-type": "application/json",
                                    **sign_registration(SigningKey.generate(), "attacker", registration)})
        assert answer.status_code == 200, answer.text
        yield service


@pytest.fixture(scope="module")
def decode(tiny_model_dir: Path, bootstrap: Service) -> Iterator[Service]:
    with start_service("node", {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32",
                                "MESHNET_DEVICE": "cpu", "MESHNET_LAYERS": "2-3", "MESHNET_NODE_ID": "d",
                                "MESHNET_ROLE": "decode", "MESHNET_BOOTSTRAP": bootstrap.url,
                                **pinned_node_env("d")}) as service:
        yield service


@pytest.fixture(scope="module")
def fakep(model_shape: KVShape) -> Iterator[FakePrefill]:
    fake = FakePrefill(model_shape)
    yield fake
    fake.close()


def step_with_handoff(decode: Service, fakep: FakePrefill, session: str) -> httpx.Response:
    """The first decode step of a handed-off prompt, as the decode route's previous hop sends it."""
    model = str(httpx.get(f"{decode.url}/health").json()["model"])
    hops = [RouteNode(node_id=name, endpoint=decode.url if name == "d" else "http://127.0.0.1:9",
                      shard_start=start, shard_end=end, hop_key=node_hop_key(name).public_text)
            for name, (start, end) in {"front": (0, 1), "d": (2, 3)}.items()]
    decode_route = sign_route(Route(model=model, nodes=plan_start_layers(hops), num_layers=4), TEST_ROUTE_KEY)
    prefill = RouteNode(node_id="fakep", endpoint=fakep.url, shard_start=0, shard_end=3,
                        hop_key=FAKE_KEY.public_text)
    prefill_route = sign_route(Route(model=model, nodes=(prefill,), num_layers=4), TEST_ROUTE_KEY)
    extra = {h.ROUTE: decode_route, h.HOP_INDEX: "1", h.START_LAYER: "2", h.STEP: "0",
             h.POSITION_OFFSET: str(POSITIONS), h.RESERVE: str(POSITIONS + 8), h.SAMPLING: GREEDY,
             HANDOFF_FROM: f"dp=0;n={POSITIONS};s=s-handoff-{session}", HANDOFF_ROUTE: prefill_route,
             "Authorization": f"Bearer {TEST_SECRET}"}
    hidden = torch.randn((1, 1, HIDDEN), generator=torch.Generator().manual_seed(3))
    headers, body = encode_frame(hidden, session=session, extra=extra)
    return httpx.post(f"{decode.url}/forward", headers=headers, content=body, timeout=60)


@pytest.mark.parametrize("mode", ["unsigned", "other_key", "replayed", "not_sealed"])
def test_kv_not_signed_by_the_route_named_prefill_node_for_this_pull_is_refused(
        decode: Service, fakep: FakePrefill, trap: socket.socket, mode: str) -> None:
    fakep.mode = mode
    before = len(fakep.pulls)
    answer = step_with_handoff(decode, fakep, f"s-{mode}")
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "handoff_failed"
    message = answer.json()["error"]["message"]
    assert "is refused" in message or "cannot be opened" in message, message
    assert len(fakep.pulls) == before + 1, "the pull went to the endpoint the signed route names"
    assert fakep.pulls[-1][KV_SOURCE] == "fakep"
    with pytest.raises(BlockingIOError):
        trap.accept()  # the registry's (hijacked) address was never dialled


def test_the_route_named_prefill_nodes_own_answer_to_this_pull_is_taken(
        decode: Service, fakep: FakePrefill, trap: socket.socket) -> None:
    fakep.mode = "good"
    answer = step_with_handoff(decode, fakep, "s-good")
    assert answer.status_code == 200, answer.text
    assert isinstance(answer.json()["token"], int)
    pull = fakep.pulls[-1]
    assert (pull[KV_SOURCE], pull[KV_LAYERS], pull[KV_CHUNK_POSITIONS].isdigit()) == ("fakep", "2-3", True)
    with pytest.raises(BlockingIOError):
        trap.accept()
