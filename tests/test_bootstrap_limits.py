"""The bootstrap service's limits, against real servers on 127.0.0.1 ephemeral ports.

A request over 4 MiB is refused without being read whole; a slow client is
cut off while other clients are served; a taken port is an error at start;
port 0 reports the port bound.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.bootstrap.server import BindError, BootstrapServer, serve
from services.bootstrap.settings import MAX_REQUEST_BYTES, BootstrapSettings
from tests.bootstrap_samples import registration
from tests.procs import REPO_ROOT, service_env, start_service

SHORT_TIMEOUT_S = 0.5
"""The read deadline of the servers here: short, so cut-offs come quickly."""
CLIENT_TIMEOUT_S = 10.0
"""How long a test client waits for any answer: well past the server's deadlines."""
CHUNK = b"x" * (64 << 10)
STARTUP_WAIT_S = 60.0


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    settings = BootstrapSettings(host="127.0.0.1", port=0, read_timeout_s=SHORT_TIMEOUT_S, access_log=False)
    with BootstrapServer(settings) as running:
        yield running


def connect(server: BootstrapServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = bytearray()
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return bytes(received)


def answered(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server has sent something (or closed) within ``wait_s``."""
    readable, _, _ = select.select([sock], [], [], wait_s)
    return bool(readable)


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def others_are_served(server: BootstrapServer) -> None:
    """Another client registers and looks up while a slow one holds its connection."""
    with httpx.Client(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as http:
        assert http.put("/route", json=registration(3, port=7003)).status_code == 200
        assert http.get("/route?engine_rank=1&target_dp_group=1").json()["rank_port"] == 7003


# --- 4 MiB ------------------------------------------------------------------------------------------

def test_a_declared_body_over_4_mib_is_refused_before_any_of_it_is_sent(server: BootstrapServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"PUT /route HTTP/1.1\r\nHost: bootstrap\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (MAX_REQUEST_BYTES + 1))
        response = read_until_closed(sock)
    assert status_of(response) == 413
    assert response.endswith(b"request body over 4194304 bytes")


def test_a_chunked_body_growing_past_4_mib_is_refused_while_it_is_still_arriving(
        server: BootstrapServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"PUT /route HTTP/1.1\r\nHost: bootstrap\r\nTransfer-Encoding: chunked\r\n\r\n")
        sent = 0
        # The body never ends (no last chunk): a server waiting for all of it would answer 408.
        while not answered(sock, 0) and sent < 2 * MAX_REQUEST_BYTES:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
            sent += len(CHUNK)
        response = read_until_closed(sock)
    assert status_of(response) == 413
    assert response.endswith(b"request body over 4194304 bytes")


def test_an_httpx_client_sending_5_mib_reads_the_413(server: BootstrapServer) -> None:
    answer = httpx.put(server.url + "/route", content=b" " * (5 << 20), timeout=CLIENT_TIMEOUT_S)
    assert (answer.status_code, answer.text) == (413, "request body over 4194304 bytes")


def test_a_body_of_exactly_4_mib_is_read(server: BootstrapServer) -> None:
    body = json.dumps(registration(0)).encode()
    padded = body + b" " * (MAX_REQUEST_BYTES - len(body))
    answer = httpx.put(server.url + "/route", content=padded, timeout=CLIENT_TIMEOUT_S)
    assert (answer.status_code, answer.text) == (200, "OK")


def test_a_request_head_that_does_not_end_is_refused(server: BootstrapServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: bootstrap\r\nX-Padding: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(64):  # 4 MiB of one header, never terminated
                if answered(sock, 0):
                    break
                sock.sendall(CHUNK)
        response = read_until_closed(sock)
    assert status_of(response) == 400


# --- slow clients ---------------------------------------------------------------------------------

def test_a_client_slow_to_send_its_body_is_cut_off_while_others_are_served(server: BootstrapServer) -> None:
    with connect(server) as slow:
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: bootstrap\r\nContent-Length: 100\r\n\r\n{\"role\"")
        others_are_served(server)
        response = read_until_closed(slow)
    assert status_of(response) == 408
    assert response.endswith(b"request body not received within 0.5 s")


def test_a_body_trickling_in_is_cut_off_at_the_deadline_not_per_byte(server: BootstrapServer) -> None:
    with connect(server) as slow:
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: bootstrap\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(1000):  # one byte every 50 ms, each well within the deadline
            if answered(slow, 0.05):
                break
            slow.sendall(b" ")
        response = read_until_closed(slow)
    assert status_of(response) == 408


def test_a_client_slow_to_send_its_head_is_disconnected_while_others_are_served(
        server: BootstrapServer) -> None:
    with connect(server) as slow:
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: boot")
        others_are_served(server)
        assert read_until_closed(slow) == b""


def test_an_idle_keep_alive_connection_gets_a_deadline_for_its_next_head(server: BootstrapServer) -> None:
    with connect(server) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: bootstrap\r\n\r\n")
        first = b""
        while not first.endswith(b"\r\n\r\nOK"):
            first += slow.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        slow.sendall(b"GET /hea")
        others_are_served(server)
        assert read_until_closed(slow) == b""


# --- binding ----------------------------------------------------------------------------------------

def test_serve_on_a_taken_port_fails_at_start(server: BootstrapServer) -> None:
    with pytest.raises(BindError, match=rf"127\.0\.0\.1:{server.port}.*in use"):
        serve(BootstrapSettings(host="127.0.0.1", port=server.port))


def test_a_port_taken_by_another_program_is_refused() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(BindError):
            BootstrapServer(BootstrapSettings(host="127.0.0.1", port=port)).start()


def test_an_unknown_host_is_a_bind_error() -> None:
    with pytest.raises(BindError, match="no-such-host.invalid"):
        BootstrapServer(BootstrapSettings(host="no-such-host.invalid", port=0)).start()


SERVE_PORT_ZERO = (
    "from services.bootstrap.server import serve\n"
    "from services.bootstrap.settings import BootstrapSettings\n"
    "serve(BootstrapSettings(host='127.0.0.1', port=0, registry='cache-layouts'))\n"
)
LISTENING = re.compile(r"bootstrap listening on http://127\.0\.0\.1:(\d+) \(registry=cache-layouts\)")


def wait_for_port(log: Path, process: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + STARTUP_WAIT_S
    while time.monotonic() < deadline:
        found = LISTENING.search(log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        assert process.poll() is None, log.read_text(errors="replace")
        time.sleep(0.05)
    raise TimeoutError(log.read_text(errors="replace"))


def test_serve_on_port_0_logs_the_port_it_bound(tmp_path: Path) -> None:
    log = tmp_path / "bootstrap.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-c", SERVE_PORT_ZERO], cwd=REPO_ROOT,
                                   env=service_env(), stdout=sink, stderr=subprocess.STDOUT)
    try:
        port = wait_for_port(log, process)
        assert port != 0
        answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=CLIENT_TIMEOUT_S)
        assert (answer.status_code, answer.text) == (200, "OK")
    finally:
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert process.wait(timeout=CLIENT_TIMEOUT_S) in (0, -signal.SIGTERM)


def test_the_app_runs_under_plain_uvicorn_configured_from_the_environment() -> None:
    with start_service("bootstrap", {"MESHNET_REGISTRY": "cache-layouts"}) as service:
        info = httpx.get(f"{service.url}/route?engine_rank=-1&target_dp_group=-1", timeout=CLIENT_TIMEOUT_S)
    assert "cache_layout" in info.json()
