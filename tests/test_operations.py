"""Operating a mesh: Prometheus metrics on every service, JSON logs, graceful node shutdown."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from tests.procs import Service, start_service, start_together

HEARTBEAT_S = "0.5"
REGISTER_TIMEOUT_S = 60.0


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def metric_names(service: Service) -> set[str]:
    """Every sample name `/metrics` exposes, parsed as Prometheus text (a parse error fails the test)."""
    answer = httpx.get(f"{service.url}/metrics", timeout=5)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    return {sample.name for family in text_string_to_metric_families(answer.text) for sample in family.samples}


def metric_total(service: Service, name: str) -> float:
    """The sum of every sample called ``name`` (all its labels), or 0 where it has none yet."""
    answer = httpx.get(f"{service.url}/metrics", timeout=5)
    return sum(sample.value for family in text_string_to_metric_families(answer.text)
               for sample in family.samples if sample.name == name)


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    """A tracker, a relay, a bootstrap registry and one whole-model node, the node logging JSON."""
    tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": HEARTBEAT_S})
    relay = start_service("relay")
    services = {"tracker": tracker, "relay": relay}
    try:
        services["bootstrap"], services["node"] = start_together([
            ("bootstrap", {"MESHNET_REGISTRY": "addresses"}),
            ("node", {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_TRACKER": tracker.url,
                      "MESHNET_RELAY": relay.url.replace("http://", "ws://"),
                      "MESHNET_NODE_ID": "ops-node", "MESHNET_DTYPE": "float32", "MESHNET_HEARTBEAT_S": HEARTBEAT_S,
                      "MESHNET_LOG_FORMAT": "json", "MESHNET_LOG_LEVEL": "info"}),
        ])
        wait_for(lambda: any(n["node_id"] == "ops-node" and n["state"] == "online"
                             for n in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]),
                 REGISTER_TIMEOUT_S, "the node to register")
        yield services
    finally:
        for service in reversed(list(services.values())):
            service.stop()


def model_id(tracker: Service) -> str:
    return httpx.get(f"{tracker.url}/v1/models").json()["data"][0]["id"]


def chat(tracker: Service, max_tokens: int = 8, stream: bool = False) -> httpx.Response:
    return httpx.post(f"{tracker.url}/v1/chat/completions", timeout=60, json={
        "model": model_id(tracker), "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens, "temperature": 0, "stream": stream})


@pytest.mark.parametrize("kind", ["tracker", "relay", "bootstrap", "node"])
def test_every_service_answers_metrics_in_prometheus_text_format(mesh: dict[str, Service], kind: str) -> None:
    assert metric_names(mesh[kind])


def test_node_metrics_count_sessions_kv_and_tokens(mesh: dict[str, Service]) -> None:
    node = mesh["node"]
    generated = metric_total(node, "meshnet_node_tokens_generated_total")
    answer = chat(mesh["tracker"])
    assert answer.status_code == 200
    names = metric_names(node)
    for expected in ("meshnet_node_sessions", "meshnet_node_kv_tokens_free", "meshnet_node_kv_tokens_used",
                     "meshnet_node_tokens_generated_total", "meshnet_node_forward_seconds_count"):
        assert expected in names, f"{expected} missing from the node's metrics"
    completion = answer.json()["usage"]["completion_tokens"]
    assert completion > 0
    assert metric_total(node, "meshnet_node_tokens_generated_total") - generated == completion
    wait_for(lambda: metric_total(node, "meshnet_node_sessions") == 0, REGISTER_TIMEOUT_S, "the session to close")
    assert metric_total(node, "meshnet_node_kv_tokens_used") == 0
    assert metric_total(node, "meshnet_node_kv_tokens_free") > 0


def test_tracker_metrics_count_requests_and_route_decisions(mesh: dict[str, Service]) -> None:
    tracker = mesh["tracker"]
    models = model_id(tracker)  # a request of its own, before the counts are read
    routes = metric_total(tracker, "meshnet_tracker_routes_total")
    requests = metric_total(tracker, "meshnet_tracker_requests_total")
    assert models and chat(tracker).status_code == 200
    names = metric_names(tracker)
    assert "meshnet_tracker_routes_total" in names
    assert "meshnet_tracker_requests_total" in names
    assert metric_total(tracker, "meshnet_tracker_routes_total") - routes == 1  # one chat, one route
    assert metric_total(tracker, "meshnet_tracker_requests_total") > requests


def test_relay_metrics_count_peers_and_bytes(mesh: dict[str, Service]) -> None:
    relay_addr = next(n["relay_addr"] for n in httpx.get(f"{mesh['tracker'].url}/v1/nodes").json()["nodes"]
                      if n["node_id"] == "ops-node")
    carried = sum(metric_total(mesh["relay"], name) for name in metric_names(mesh["relay"])
                  if name.startswith("meshnet_relay_bytes"))
    with connect(relay_addr, open_timeout=10) as ws:  # the reference envelope, through the relay to the node
        ws.send(orjson.dumps({"request_id": "1", "method": "GET", "path": "/health", "headers": {},
                              "body_base64": ""}).decode())
        assert orjson.loads(ws.recv(timeout=10))["status"] == 200
    names = metric_names(mesh["relay"])
    assert "meshnet_relay_peers" in names
    assert metric_total(mesh["relay"], "meshnet_relay_peers") == 1  # the node, holding its link
    bytes_names = [name for name in names if name.startswith("meshnet_relay_bytes")]
    assert bytes_names
    assert sum(metric_total(mesh["relay"], name) for name in bytes_names) > carried


def test_bootstrap_metrics_count_requests(mesh: dict[str, Service]) -> None:
    names = [name for name in metric_names(mesh["bootstrap"]) if name.startswith("meshnet_bootstrap_requests")]
    before = sum(metric_total(mesh["bootstrap"], name) for name in names if name.endswith("_total"))
    assert httpx.get(f"{mesh['bootstrap'].url}/health").status_code == 200
    names = [name for name in metric_names(mesh["bootstrap"]) if name.startswith("meshnet_bootstrap_requests")]
    assert names
    assert sum(metric_total(mesh["bootstrap"], name) for name in names if name.endswith("_total")) > before


def test_json_logs_are_one_object_per_line(mesh: dict[str, Service]) -> None:
    records = [orjson.loads(line) for line in mesh["node"].log().splitlines() if line.startswith("{")]
    assert records, f"no JSON log line in:\n{mesh['node'].log()}"
    assert all({"time", "level", "logger", "message"} <= set(record) for record in records)


def test_a_node_stopped_with_sigterm_finishes_its_stream_and_deregisters(mesh: dict[str, Service]) -> None:
    tracker, node = mesh["tracker"], mesh["node"]
    chunks: list[str] = []
    done = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{tracker.url}/v1/chat/completions", timeout=60, json={
                "model": model_id(tracker), "messages": [{"role": "user", "content": "tell me a story"}],
                "max_tokens": 200, "temperature": 0, "stream": True}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data:"):
                    chunks.append(line[5:].strip())
        done.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    wait_for(lambda: len(chunks) >= 3, 30, "the stream to start")
    node.proc.send_signal(signal.SIGTERM)
    assert done.wait(60), "the stream never finished after SIGTERM"
    assert chunks[-1] == "[DONE]"
    events = [orjson.loads(c) for c in chunks[:-1]]
    assert not any("error" in event for event in events), "the stream in flight was cut off by a graceful stop"
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert node.proc.wait(timeout=30) is not None
    nodes = httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]
    assert all(n["state"] == "offline" for n in nodes if n["node_id"] == "ops-node")
    assert httpx.get(f"{tracker.url}/v1/models").json()["data"] == []
