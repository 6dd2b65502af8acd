"""Start real meshnet services as processes for integration tests.

Each service runs as `python -m uvicorn services.<kind>.app:app` on 127.0.0.1
with an ephemeral port, configured only through `MESHNET_*` environment
variables, exactly as a user runs it in production; `launcher="meshnet"` runs
`meshnet <kind>` instead (its `serve`: TLS from `MESHNET_TLS_CERT`/`KEY`, the
slow-client guards). A service with a certificate is reached over https,
verified with `MESHNET_TLS_CA`. `start_service` waits for
`GET /health` to answer 200 and raises with the service's log when it does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, Self, TypeVar

import httpx
import orjson

from meshwire.route_keys import SigningKey, b64encode, jwks_of
from services.node.engine.openmp import OPENMP_DEFAULTS

ServiceKind = Literal["tracker", "node", "relay", "bootstrap"]
Launcher = Literal["uvicorn", "meshnet"]

REPO_ROOT = Path(__file__).resolve().parent.parent
TEST_SECRET = "test-" + secrets.token_urlsafe(24)
"""The mesh secret of the test services: made per test run, so that services the tests bind beyond
loopback (network namespaces) hold no published secret, which they would refuse."""
TEST_ROUTE_KEY = SigningKey.from_seed(b64encode(hashlib.sha256(b"meshnet test route key").digest()))
"""Signs routes in tests whose nodes run without a tracker, as the tracker's key would."""
TEST_ROUTE_KEYS = jwks_of([TEST_ROUTE_KEY]).model_dump_json()
"""Its public half as a JWK set: ``MESHNET_ROUTE_KEYS`` of those nodes."""


def node_hop_key(name: str) -> SigningKey:
    """A fixed hop key for the node called ``name`` (``MESHNET_NODE_KEY``), so a test can name it in routes."""
    return SigningKey.from_seed(b64encode(hashlib.sha256(f"meshnet test node key {name}".encode()).digest()))


def pinned_node_env(name: str, tracker: Service | None = None) -> dict[str, str]:
    """What a node without a tracker needs to run routes a test signs: the test's route key and a known hop key.

    With ``tracker`` (one reached across a network by plain HTTP, where a node with pins fetches no keys), the
    tracker's published keys are pinned too, read here from the test process as an operator would pin them.
    """
    keys = TEST_ROUTE_KEYS
    if tracker is not None:
        published = httpx.get(f"{tracker.url}/v1/keys", verify=tracker.verify, timeout=30).json()["keys"]
        keys = orjson.dumps({"keys": [*orjson.loads(TEST_ROUTE_KEYS)["keys"], *published]}).decode()
    return {"MESHNET_ROUTE_KEYS": keys, "MESHNET_NODE_KEY": node_hop_key(name).seed_text}
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


MAX_PORT_TRIES = 100
_HANDED_OUT: set[int] = set()
"""Ports :func:`free_port` already gave this test process: the kernel may hand a port just released to the
next ``bind(0)``, and services started together (``wait_ready=False``) would then race for one port."""


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that is free right now on `host`, and not one this process was given before."""
    for _ in range(MAX_PORT_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no fresh free port found in {MAX_PORT_TRIES} tries")


def free_ports_in_a_row(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports that are all free right now (``meshnet up --node-port``
    gives its nodes the ports that follow the first)."""
    for _ in range(MAX_PORT_TRIES):
        first = free_port(host)
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((host, port))
            except OSError:
                continue
            return first
    raise RuntimeError(f"no {count} consecutive free ports found in {MAX_PORT_TRIES} tries")


@dataclass
class Service:
    """A running service process and how to reach it."""

    kind: ServiceKind
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        scheme = "https" if self.env.get("MESHNET_TLS_CERT") else "http"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What an httpx client reaching this service verifies it with (its ``MESHNET_TLS_CA``, else the default)."""
        ca = self.env.get("MESHNET_TLS_CA")
        return ssl.create_default_context(cafile=ca) if ca else True

    def log(self) -> str:
        """Everything the service wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (SIGKILL by default: a crash, no goodbye) and reap the process."""
        if self.alive():
            self.proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Stop gracefully (SIGTERM), escalating to SIGKILL."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


PASSED_THROUGH: Final = frozenset({"MESHNET_KERNEL_CACHE"})
"""The runner's own ``MESHNET_*`` its services keep: where the native kernels are built (engineers sharing one
machine each keep theirs, or every changed kernel source rebuilds and deletes the others' builds)."""


def service_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a test service runs with: the caller's MESHNET_* over safe defaults."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_") or k in PASSED_THROUGH}
    base.update(
        {
            "MESHNET_SECRET": TEST_SECRET,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
            # `auto` speculation decides from measured round trips, which a busy machine stretches: tests pin
            # it off, and the speculation tests turn it on where they mean to.
            "MESHNET_SPECULATE": "off",
            # The exactness tests compare quantized nodes with float32 rows: `auto` takes int8 rows on a CPU with
            # VNNI/AMX. Tests of int8 activations turn them on where they mean to.
            "MESHNET_ACTIVATIONS": "float32",
            **OPENMP_DEFAULTS,
        }
    )
    base.update(env or {})
    return base


def start_service(
    kind: ServiceKind,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    wrapper: Sequence[str] = (),
    ready_timeout_s: float = READY_TIMEOUT_S,
    wait_ready: bool = True,
    launcher: Launcher = "uvicorn",
) -> Service:
    """Start `services.<kind>.app:app` under uvicorn and wait until `/health` is 200.

    `wrapper` prefixes the command (e.g. `ip netns exec NS`); `host` is where
    the service listens and where readiness is probed.
    """
    port = port or free_port()
    full_env = service_env(env)
    full_env.setdefault("MESHNET_HOST", host)
    full_env["MESHNET_PORT"] = str(port)
    log_file = tempfile.NamedTemporaryFile(prefix=f"meshnet-{kind}-{port}-", suffix=".log", delete=False)  # noqa: SIM115 - the service's log outlives this call
    if launcher == "meshnet":
        cmd = [*wrapper, sys.executable, "-m", "meshnet.cli", "--log-level", "warning", kind]
    else:
        cmd = [
            *wrapper,
            sys.executable,
            "-m",
            "uvicorn",
            f"services.{kind}.app:app",
            "--host",
            host,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=log_file, stderr=subprocess.STDOUT)
    service = Service(kind=kind, port=port, proc=proc, log_path=Path(log_file.name), host=host, env=full_env)
    if wait_ready:
        try:
            wait_healthy(service, ready_timeout_s)
        except Exception:
            service.kill()
            raise
    return service


def wait_healthy(service: Service, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll `/health` until 200; fail with the service's log if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not service.alive():
            raise RuntimeError(f"{service.kind} on port {service.port} exited early:\n{service.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{service.url}/health", timeout=2.0, verify=service.verify).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{service.kind} on port {service.port} not healthy after {timeout_s}s:\n{service.log()}")


@contextlib.contextmanager
def running(*services: Service) -> Iterator[tuple[Service, ...]]:
    """Stop every service on exit, whatever happens in the block."""
    try:
        yield services
    finally:
        for service in reversed(services):
            service.stop()


def start_together(specs: Sequence[tuple[ServiceKind, Mapping[str, str]]],
                   ports: Sequence[int | None] | None = None,
                   ready_timeout_s: float = READY_TIMEOUT_S) -> list[Service]:
    """Start several services at once (they load in parallel), then wait until each is healthy (each within
    ``ready_timeout_s``); ``ports`` gives each its port (``None``: a free one).

    If any fails to come up, every one started is stopped before the error propagates.
    """
    chosen = list(ports) if ports is not None else [None] * len(specs)
    services = [start_service(kind, env, port, wait_ready=False) for (kind, env), port in zip(specs, chosen,
                                                                                              strict=True)]
    try:
        for service in services:
            wait_healthy(service, ready_timeout_s)
    except Exception:
        for service in services:
            service.kill()
        raise
    return services


@contextlib.contextmanager
def named_nodes(layers: Mapping[str, tuple[int, int]], common: Mapping[str, str],
                extra: Mapping[str, Mapping[str, str]] | None = None) -> Iterator[dict[str, Service]]:
    """Nodes without a tracker, one per ``layers`` entry (its name: ``(start, end)``), each with its pinned
    route key and hop key (:func:`pinned_node_env`), ``common`` and its own ``extra`` settings; started
    together, healthy on entry, stopped on exit."""
    started: dict[str, Service] = {}
    try:
        for name, (start, end) in layers.items():
            started[name] = start_service("node", {**common, **pinned_node_env(name), "MESHNET_NODE_ID": name,
                                                   "MESHNET_LAYERS": f"{start}-{end}", **(extra or {}).get(name, {})},
                                          wait_ready=False)
        for service in started.values():
            wait_healthy(service)
        yield started
    finally:
        for service in started.values():
            service.stop()


T = TypeVar("T")
WAIT_S: Final = 120.0
"""How long :func:`wait_for` waits for a state by default: generous, for a loaded machine; it returns at once."""


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = WAIT_S) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; a service that does not answer
    yet (an ``httpx.HTTPError``) counts as not yet. Fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if value := condition():
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {what}")
