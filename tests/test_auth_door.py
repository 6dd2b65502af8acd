"""The node's front door (``services.node.hop.auth``), with real processes: a credential is checked from the
headers, before a byte of the body is read, and the mesh's calls carry what a replay or a flood cannot reuse.

Two nodes of the tiny model, ``front`` (0-1, a head) and ``back`` (2-3, the tail), run routes signed with the
test's route key (as the tracker's would be). The test process is the attacker of issue 34: it reaches the
ports, knows the public route keys and may hold a real route token, but none of the nodes' hop keys.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
import torch

from meshwire import headers as h
from meshwire.auth import bearer_headers
from meshwire.frames import encode_frame
from meshwire.hop_proof import NONCE, TRACKER_SIGNER_PREFIX, sign_request
from meshwire.limits import MIB
from meshwire.route_keys import SigningKey
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    named_nodes,
    node_hop_key,
)

NUM_LAYERS = 4
HIDDEN = 64
LAYERS = {"front": (0, 1), "back": (2, 3)}
ANSWER_TIMEOUT_S = 60.0
"""How long the attacker waits for an answer having sent headers only: a node that waited for the body instead
would never answer within it (nothing is sent), so this bounds a failing run, not a passing one."""
CONCURRENT = 6
LARGE_BODY = 60 * MIB


@pytest.fixture(scope="module")
def nodes(tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    common = {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu"}
    with named_nodes(LAYERS, common) as started:
        yield started


def model_of(nodes: dict[str, Service]) -> str:
    return str(httpx.get(f"{nodes['front'].url}/health").json()["model"])


def route(nodes: dict[str, Service]) -> str:
    """A real route front -> back, signed with the test's route key as the tracker would sign it."""
    hops = [RouteNode(node_id=name, endpoint=nodes[name].url, shard_start=start, shard_end=end, start_layer=start,
                      hop_key=node_hop_key(name).public_text) for name, (start, end) in LAYERS.items()]
    return sign_route(Route(model=model_of(nodes), nodes=plan_start_layers(hops), num_layers=NUM_LAYERS),
                      TEST_ROUTE_KEY)


def made_up_proof(signer: str, path: str, headers: dict[str, str], declared_body: bytes = b"") -> dict[str, str]:
    """Proof headers in ``signer``'s name, signed with a key nobody vouches for (well formed, so only the
    signature check can refuse them)."""
    return sign_request(SigningKey.generate(), signer, path, headers, declared_body)


def answer_to_headers_only(service: Service, path: str, headers: dict[str, str], content_length: int) -> tuple[int, dict]:
    """Send a request's headers announcing ``content_length`` bytes, send none of them, and read the answer.

    A node that checks the credential first answers at once; one that reads the body first waits forever.
    """
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{service.port}", f"Content-Length: {content_length}",
             "Content-Type: application/octet-stream", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    with socket.create_connection(("127.0.0.1", service.port), timeout=ANSWER_TIMEOUT_S) as sock:
        sock.sendall("\r\n".join(lines).encode())
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            assert chunk, "the node closed the connection without an answer"
            received += chunk
        head, _, rest = received.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        while len(rest) < length:
            chunk = sock.recv(65536)
            assert chunk
            rest += chunk
    return status, orjson.loads(rest[:length])


def frame_headers(nodes: dict[str, Service], tokens: int, session: str = "s-attack") -> dict[str, str]:
    """The headers of a real-looking data frame for ``back`` (hop 1), without the body."""
    hidden = torch.zeros((1, 1, HIDDEN))
    headers, _ = encode_frame(hidden, session=session, extra={
        h.ROUTE: route(nodes), h.HOP_INDEX: "1", h.START_LAYER: "2", h.STEP: "0", h.POSITION_OFFSET: "0",
        h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}'})
    headers[h.SHAPE] = f"1,{tokens},{HIDDEN}"
    return {k: v for k, v in headers.items() if k.lower() != "content-length"}


def rss_kib(service: Service) -> int:
    status = Path(f"/proc/{service.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))


# --- finding 3: memory before authentication -------------------------------------------------------------


def test_a_frame_with_a_made_up_proof_is_refused_before_its_body_is_sent(nodes: dict[str, Service]) -> None:
    tokens = LARGE_BODY // (HIDDEN * 4)
    headers = frame_headers(nodes, tokens)
    headers.update(made_up_proof("front", "/forward", headers, b"\0" * 16))
    status, body = answer_to_headers_only(nodes["back"], "/forward", headers, tokens * HIDDEN * 4)
    assert status == 403 and body["error"]["code"] == "bad_proof", body


def test_a_batch_with_a_made_up_proof_is_refused_before_its_body_is_sent(nodes: dict[str, Service]) -> None:
    batch = {h.WIRE: h.WIRE_VERSION, h.ROUTE: route(nodes), h.HOP_INDEX: "1"}
    forged = {**batch, **made_up_proof("front", "/forward/rows", batch)}
    status, body = answer_to_headers_only(nodes["back"], "/forward/rows", forged, 70 * MIB)
    assert status == 403 and body["error"]["code"] == "bad_proof", body
    unnamed = {h.WIRE: h.WIRE_VERSION}  # no route of its own to vouch for the signer's key: refused as well
    status, body = answer_to_headers_only(nodes["back"], "/forward/rows",
                                          {**unnamed, **made_up_proof("front", "/forward/rows", unnamed)}, 70 * MIB)
    assert status == 403 and body["error"]["code"] == "bad_route", body


def test_a_call_in_the_trackers_name_with_a_made_up_proof_is_refused_before_its_body_is_sent(
        nodes: dict[str, Service]) -> None:
    sent = {"Content-Type": "application/json", h.ROUTE: route(nodes)}
    forged = {**sent, **made_up_proof(f"{TRACKER_SIGNER_PREFIX}{TEST_ROUTE_KEY.kid}", "/v1/chat/completions", sent)}
    status, body = answer_to_headers_only(nodes["front"], "/v1/chat/completions", forged, 8 * MIB - 1)
    assert status == 403 and body["error"]["code"] == "forbidden", body


def test_concurrent_large_bodies_with_made_up_proofs_cost_the_node_no_memory(nodes: dict[str, Service]) -> None:
    """Issue 34's probe: 6 concurrent 70 MB bodies with a made-up proof grew the node's RSS by 387 MB."""
    back = nodes["back"]
    batch = {h.WIRE: h.WIRE_VERSION, h.ROUTE: route(nodes), h.HOP_INDEX: "1"}
    body = b"\0" * (70 * MIB)
    before = rss_kib(back)

    def attack(_: int) -> int | str:
        forged = {**batch, **made_up_proof("front", "/forward/rows", batch, body)}
        try:
            return httpx.post(f"{back.url}/forward/rows", headers=forged, content=body, timeout=120).status_code
        except httpx.TransportError:  # the node answered and closed the connection while the body was on its way
            return "closed"

    with ThreadPoolExecutor(CONCURRENT) as pool:
        statuses = list(pool.map(attack, range(CONCURRENT)))
    grown_mib = (rss_kib(back) - before) / 1024
    assert set(statuses) <= {403, "closed"}, statuses
    assert grown_mib < 70, f"the node's RSS grew by {grown_mib:.0f} MiB refusing forged batches"


# --- finding 9: sample draws --------------------------------------------------------------------------------


def test_a_replay_asking_for_more_draws_than_its_positions_is_refused(nodes: dict[str, Service]) -> None:
    hidden = torch.randn((1, 3, HIDDEN), generator=torch.Generator().manual_seed(1))
    headers, body = encode_frame(hidden, session="s-draws", extra={
        h.ROUTE: route(nodes), h.HOP_INDEX: "1", h.START_LAYER: "2", h.STEP: "0", h.POSITION_OFFSET: "0",
        h.SAMPLING: '{"temperature": 0.8, "top_p": 1.0, "top_k": 0, "seed": 3}', h.SAMPLE_DRAWS: "1048576",
        **bearer_headers(TEST_SECRET)})
    refused = httpx.post(f"{nodes['back'].url}/forward", headers=headers, content=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "bad_header", refused.text
    assert h.SAMPLE_DRAWS in refused.json()["error"]["message"]
    assert httpx.get(f"{nodes['back'].url}/health").json()["sessions"] == 0, "the refused frame opened nothing"
    headers[h.SAMPLE_DRAWS] = "2"  # a replay of 3 positions may have drawn 2 tokens: served
    headers[h.SESSION] = "s-draws-ok"
    served = httpx.post(f"{nodes['back'].url}/forward", headers=headers, content=body, timeout=60)
    assert served.status_code == 200, served.text


# --- finding 12: the tracker's calls to a head ------------------------------------------------------------


def tracker_call(nodes: dict[str, Service]) -> tuple[dict[str, str], bytes]:
    body = orjson.dumps({"model": model_of(nodes), "messages": [{"role": "user", "content": "Hello"}],
                         "max_tokens": 2, "temperature": 0})
    sent = {"Content-Type": "application/json", h.ROUTE: route(nodes)}
    return {**sent, **sign_request(TEST_ROUTE_KEY, f"{TRACKER_SIGNER_PREFIX}{TEST_ROUTE_KEY.kid}",
                                   "/v1/chat/completions", sent, body)}, body


def test_a_replayed_call_of_the_tracker_is_refused(nodes: dict[str, Service]) -> None:
    headers, body = tracker_call(nodes)
    url = f"{nodes['front'].url}/v1/chat/completions"
    first = httpx.post(url, headers=headers, content=body, timeout=120)
    assert first.status_code == 200, first.text
    again = httpx.post(url, headers=headers, content=body, timeout=120)
    assert again.status_code == 403 and again.json()["error"]["code"] == "replayed", again.text
    fresh_headers, fresh_body = tracker_call(nodes)  # the tracker's next call: a new nonce, answered
    assert httpx.post(url, headers=fresh_headers, content=fresh_body, timeout=120).status_code == 200


def test_a_call_of_the_tracker_without_a_nonce_is_refused(nodes: dict[str, Service]) -> None:
    headers, body = tracker_call(nodes)
    headers.pop(NONCE)
    refused = httpx.post(f"{nodes['front'].url}/v1/chat/completions", headers=headers, content=body, timeout=60)
    assert refused.status_code == 401, refused.text


def test_a_call_of_the_tracker_whose_body_was_swapped_is_refused(nodes: dict[str, Service]) -> None:
    headers, body = tracker_call(nodes)
    swapped = body.replace(b'"max_tokens":2', b'"max_tokens":9')
    refused = httpx.post(f"{nodes['front'].url}/v1/chat/completions", headers=headers, content=swapped, timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "bad_proof", refused.text
