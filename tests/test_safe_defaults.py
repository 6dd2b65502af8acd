"""No service beyond loopback with an empty or published secret; loopback works with nothing set.

Real processes: ``meshnet <service> --host 0.0.0.0`` (and a bare ``uvicorn
services.<service>.app:app`` told ``MESHNET_HOST=0.0.0.0``) with an empty or a
known secret exits non-zero, naming ``MESHNET_SECRET`` and how to make one,
before it serves anything.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time

import httpx
import pytest

from meshwire.auth import DEFAULT_SECRET
from meshwire.exposure import KNOWN_SECRETS, MAKE_A_SECRET, UnsafeSecret, is_loopback, require_private_secret
from tests.procs import READY_TIMEOUT_S, REPO_ROOT, free_port, running, start_service

EXIT_WAIT_S = 120.0
"""Far above what a refusal takes (no model is loaded before the check)."""
PUBLISHED = ("change-me-mesh-secret", DEFAULT_SECRET, "change-me-to-a-long-random-string")


def _env(secret: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    if secret is not None:
        env["MESHNET_SECRET"] = secret
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=EXIT_WAIT_S, check=False)


@pytest.mark.parametrize("kind", ["tracker", "node", "relay"])
@pytest.mark.parametrize("secret", ["", *PUBLISHED])
def test_a_service_on_every_interface_with_a_known_or_empty_secret_refuses_to_start(kind: str, secret: str) -> None:
    env = _env(secret, MESHNET_MODEL="unused-model-name")
    done = _run(["-m", "meshnet.cli", kind, "--host", "0.0.0.0", "--port", str(free_port())], env)
    assert done.returncode != 0
    assert "MESHNET_SECRET" in done.stderr
    assert MAKE_A_SECRET in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["tracker", "relay"])
def test_a_bare_uvicorn_told_it_listens_everywhere_refuses_the_default_secret(kind: str) -> None:
    port = str(free_port())
    done = _run(["-m", "uvicorn", f"services.{kind}.app:app", "--host", "0.0.0.0", "--port", port],
                _env(None, MESHNET_HOST="0.0.0.0", MESHNET_PORT=port))
    assert done.returncode != 0
    assert "MESHNET_SECRET" in done.stderr


def test_meshnet_up_on_every_interface_with_the_default_secret_refuses_before_starting_anything() -> None:
    done = _run(["-m", "meshnet.cli", "up", "--host", "0.0.0.0", "--model", "unused-model-name"], _env(None))
    assert done.returncode == 2
    assert "MESHNET_SECRET" in done.stderr and MAKE_A_SECRET in done.stderr


def test_a_tracker_on_loopback_starts_with_nothing_set() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "tracker", "--port", str(port)], cwd=REPO_ROOT,
                            env=_env(None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert proc.poll() is None, "the tracker exited"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the tracker never became healthy"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_service_on_every_interface_with_a_secret_of_its_own_serves() -> None:
    secret = secrets.token_urlsafe(32)
    relay = start_service("relay", {"MESHNET_SECRET": secret, "MESHNET_HOST": "0.0.0.0"}, launcher="meshnet")
    with running(relay):
        assert relay.alive()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_hosts_are_recognised(host: str) -> None:
    assert is_loopback(host)
    for secret in ("", *KNOWN_SECRETS):
        require_private_secret("the tracker", host, secret)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "tracker.example.org", "192.168.1.2"])
def test_any_other_host_needs_a_private_secret(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(UnsafeSecret, match="MESHNET_SECRET"):
        require_private_secret("the tracker", host, "change-me-mesh-secret")
    with pytest.raises(UnsafeSecret, match="is empty"):
        require_private_secret("the tracker", host, "  ")
    require_private_secret("the tracker", host, secrets.token_urlsafe(32))
