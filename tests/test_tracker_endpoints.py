"""A node cannot aim the tracker at internal addresses, nor read back what an internal address answers.

The attack (issue 34, finding 10): a member registers an ``endpoint`` on the
cloud metadata address or an internal service; the tracker then calls it with
every request it routes there, and ``GET /v1/nodes`` showed up to 200
characters of what answered in ``last_failure_reason``. Now (real trackers):

- link-local and metadata endpoints and relay addresses are refused at
  registration, 400 ``forbidden_address``, whatever the operator allows;
- with ``MESHNET_ALLOW_PRIVATE_ENDPOINTS=0`` loopback and private ones are too;
- a failure is listed as one word of a fixed vocabulary: an internal service's
  words never reach ``/v1/nodes``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

import httpx
import pytest

from services.tracker.failure_kinds import FAILURE_KINDS, failure_kind
from tests.procs import TEST_SECRET, Service, start_service

AUTH: Final = {"Authorization": f"Bearer {TEST_SECRET}"}
INTERNAL_SECRET: Final = "db-password-hunter2"


@pytest.fixture(scope="module")
def tracker() -> Iterator[Service]:
    with start_service("tracker", {"MESHNET_FAILURE_BACKOFF_S": "1"}) as service:
        yield service


@pytest.fixture(scope="module")
def public_tracker() -> Iterator[Service]:
    with start_service("tracker", {"MESHNET_ALLOW_PRIVATE_ENDPOINTS": "0"}) as service:
        yield service


def registration(endpoint: str, relay_addr: str | None = None, model: str = "m") -> dict[str, Any]:
    body: dict[str, Any] = {"node_id": f"n-{uuid.uuid4().hex[:8]}", "model": model, "endpoint": endpoint,
                            "shard_start": 0, "shard_end": 0, "num_layers": 1}
    if relay_addr is not None:
        body["relay_addr"] = relay_addr
    return body


def register(tracker: Service, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{tracker.url}/v1/nodes", json=body, headers=AUTH, timeout=30)


@pytest.mark.parametrize(("endpoint", "relay_addr", "field"), [
    ("http://169.254.169.254", None, "endpoint"),
    ("http://169.254.169.254:80/latest", None, "endpoint"),
    ("http://[fe80::1]:8000", None, "endpoint"),
    ("http://[fd00:ec2::254]", None, "endpoint"),
    ("http://metadata.google.internal", None, "endpoint"),
    ("http://0.0.0.0:8000", None, "endpoint"),
    ("http://127.0.0.1:9", "ws://169.254.169.254/rpc/x", "relay_addr"),
])
def test_metadata_and_link_local_addresses_are_refused_whatever_the_operator_allows(
        tracker: Service, endpoint: str, relay_addr: str | None, field: str) -> None:
    answer = register(tracker, registration(endpoint, relay_addr))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("forbidden_address", field)


def test_private_addresses_register_by_default_and_not_on_a_public_mesh(tracker: Service,
                                                                         public_tracker: Service) -> None:
    for endpoint in ("http://127.0.0.1:9", "http://10.1.2.3:8000", "http://localhost:8000"):
        assert register(tracker, registration(endpoint)).status_code == 200
        refused = register(public_tracker, registration(endpoint))
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "forbidden_address", refused.text
        assert "MESHNET_ALLOW_PRIVATE_ENDPOINTS" in refused.json()["error"]["message"]
    assert register(public_tracker, registration("http://8.8.8.8:8000")).status_code == 200


class InternalService:
    """An internal HTTP service the attacker's endpoint names: it answers a secret in an error's words."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = (b'{"error": {"message": "' + INTERNAL_SECRET.encode() + b' refused to talk", '
                        b'"type": "server_error", "code": "internal"}}')
                self.send_response(502)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_what_an_internal_address_answers_never_reaches_the_node_list(tracker: Service) -> None:
    internal = InternalService()
    try:
        body = registration(internal.url, model="probe-model")
        assert register(tracker, body).status_code == 200
        httpx.post(f"{tracker.url}/v1/chat/completions", timeout=30,
                   json={"model": "probe-model", "messages": [{"role": "user", "content": "hi"}]})
        listed = httpx.get(f"{tracker.url}/v1/nodes", headers=AUTH).json()["nodes"]
        node = next(n for n in listed if n["node_id"] == body["node_id"])
        assert node["last_failure_reason"] in FAILURE_KINDS, node
        assert node["last_failure_reason"] is not None
        assert INTERNAL_SECRET not in httpx.get(f"{tracker.url}/v1/nodes", headers=AUTH).text
    finally:
        internal.server.shutdown()
        internal.server.server_close()


@pytest.mark.parametrize(("reason", "kind"), [
    ("ConnectError: [Errno 111] Connection refused", "refused"),
    ("ReadTimeout: timed out", "timeout"),
    ("answered 500 with a body that is not an OpenAI error", "http_5xx"),
    ("answered 404 with no body", "http_4xx"),
    ("answered 200 with content type 'text/html'", "bad_answer"),
    ("broke mid-answer: RemoteProtocolError: peer closed", "broke_mid_answer"),
    ("reset by peer", "reset"),
    ("ConnectError: [Errno -2] Name or service not known", "unreachable"),
    (f"{INTERNAL_SECRET}: <html>admin panel</html>", "failed"),
    ("timeout", "timeout"),
])
def test_a_failure_reason_is_one_word_of_the_vocabulary(reason: str, kind: str) -> None:
    assert failure_kind(reason) == kind
