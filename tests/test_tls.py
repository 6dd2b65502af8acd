"""TLS end to end: a tracker and two nodes serving HTTPS with a certificate made here, verified by every client.

The nodes register and heartbeat with the tracker over https, the tracker
reaches the head over https, the head reaches the tail over https, and the
official OpenAI client talks to the tracker over https; each verifies the
other with the test's CA (``MESHNET_TLS_CA``).
"""

from __future__ import annotations

import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import REPO_ROOT, Service, service_env
from tests.tiny_mesh import tiny_mesh
from tests.tls_pki import Pki, make_pki

CHAT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path, pki: Pki) -> Iterator[tuple[Service, str]]:
    env = {"MESHNET_TLS_CERT": str(pki.cert), "MESHNET_TLS_KEY": str(pki.key), "MESHNET_TLS_CA": str(pki.ca)}
    with tiny_mesh(tiny_model_dir, env=env, launcher="meshnet") as running:
        yield running


def _trusting(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki.ca))


def test_a_chat_over_https_is_answered_through_the_openai_client(mesh: tuple[Service, str], pki: Pki) -> None:
    tracker, model = mesh
    assert tracker.url.startswith("https://")
    with httpx.Client(verify=_trusting(pki)) as http:
        client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120,
                               http_client=http)
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=6, temperature=0)
        streamed = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                                  max_tokens=6, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    assert answer.choices[0].message.content
    assert text == answer.choices[0].message.content


def test_every_node_registered_an_https_endpoint(mesh: tuple[Service, str], pki: Pki) -> None:
    tracker, _ = mesh
    nodes = httpx.get(f"{tracker.url}/v1/nodes", verify=_trusting(pki)).json()["nodes"]
    assert len(nodes) == 2
    assert all(node["endpoint"].startswith("https://127.0.0.1:") for node in nodes)
    assert {node["state"] for node in nodes} <= {"online", "joining"}


def test_a_client_that_does_not_trust_the_ca_is_refused_by_its_own_verification(mesh: tuple[Service, str]) -> None:
    tracker, _ = mesh
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tracker.url}/health")


def test_plain_http_gets_no_answer_from_an_https_service(mesh: tuple[Service, str]) -> None:
    tracker, _ = mesh
    plain = tracker.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/health", timeout=10)


def test_meshnet_chat_verifies_an_https_tracker_with_its_ca(mesh: tuple[Service, str], pki: Pki) -> None:
    tracker, _ = mesh
    args = [sys.executable, "-m", "meshnet.cli", "chat", "--url", tracker.url, "--max-tokens", "4", "hello"]
    trusted = subprocess.run([*args[:4], "--tls-ca", str(pki.ca), *args[4:]], cwd=REPO_ROOT, env=service_env(),
                             capture_output=True, text=True, timeout=CHAT_TIMEOUT_S, check=False)
    assert trusted.returncode == 0, trusted.stderr
    assert trusted.stdout.strip()
    untrusted = subprocess.run(args, cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True,
                               timeout=CHAT_TIMEOUT_S, check=False)
    assert untrusted.returncode != 0
    # refused for the certificate, by the CLI's own verification (not, say, a connection or usage error)
    assert "cannot reach the mesh" in untrusted.stderr and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, \
        untrusted.stderr
    assert not untrusted.stdout.strip()
