"""PD fallback reasons with real processes, beyond those test_pd_handoff asserts: a prefill node whose
handoffs may hold fewer bytes than a prompt's KV (``MESHNET_HANDOFF_MAX_BYTES``) cannot hand the prompt
over; and a decode head whose bootstrap registry is gone cannot look the prefill group up. Either way the
decode route prefills the prompt itself and answers, and the decode head counts the fallback under its
reason and logs why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.pd_mesh import PdMesh, start_pd_mesh

LONG: Final = [{"role": "user", "content": " ".join(["Tell me a long story about the river and the old mill."] * 12)}]
HANDOFF_MAX_BYTES: Final = 1 << 16
"""The least the setting allows: below the long prompt's KV on the tiny model."""


def pd_counts(mesh: PdMesh, name: str) -> dict[str, float]:
    """The node's PD fallbacks by reason and PD requests by outcome (``fallback``, ``handoff``)."""
    text = httpx.get(f"{mesh.url(name)}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshnet_node_pd_fallbacks_total":
                counts[sample.labels["reason"]] = sample.value
            elif sample.name == "meshnet_node_pd_requests_total":
                counts[sample.labels["outcome"]] = sample.value
    return counts


def moved(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def small_handoffs(tiny_model_dir: Path) -> Iterator[PdMesh]:
    running = start_pd_mesh(tiny_model_dir, {"p": (0, 3)}, {"d": (0, 3)},
                            prefill_env={"MESHNET_HANDOFF_MAX_BYTES": str(HANDOFF_MAX_BYTES)})
    try:
        yield running
    finally:
        running.stop()


def test_a_handoff_over_the_prefill_node_s_byte_bound_falls_back_as_prefill_failed(small_handoffs: PdMesh) -> None:
    mesh = small_handoffs
    before = pd_counts(mesh, "d")
    answer = httpx.post(f"{mesh.tracker.url}/v1/chat/completions", timeout=120,
                        json={"model": mesh.model, "messages": LONG, "max_tokens": 8, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 8
    after = pd_counts(mesh, "d")
    assert moved(after, before, "prefill_failed") == 1 and moved(after, before, "fallback") == 1, after
    assert moved(after, before, "handoff") == 0, after
    refusals = [line for line in mesh.nodes["d"].log().splitlines() if "(prefill_failed)" in line]
    assert refusals and "does not fit" in refusals[-1] and f"of {HANDOFF_MAX_BYTES} bytes are held for handoffs" \
        in refusals[-1], refusals


@pytest.fixture(scope="module")
def plain_pd(tiny_model_dir: Path) -> Iterator[PdMesh]:
    running = start_pd_mesh(tiny_model_dir, {"p": (0, 3)}, {"d": (0, 3)})
    try:
        yield running
    finally:
        running.stop()


def test_a_decode_head_without_its_registry_falls_back_as_bootstrap(plain_pd: PdMesh) -> None:
    """The registry stops after every node registered: the prefill route still prefills, but the decode head
    cannot look up where the prompt's KV is, so its route prefills the prompt itself."""
    mesh = plain_pd
    mesh.bootstrap.stop()
    before = pd_counts(mesh, "d")
    answer = httpx.post(f"{mesh.tracker.url}/v1/chat/completions", timeout=120,
                        json={"model": mesh.model, "messages": LONG, "max_tokens": 8, "temperature": 0})
    assert answer.status_code == 200, answer.text
    after = pd_counts(mesh, "d")
    assert answer.json()["usage"]["completion_tokens"] == 8
    assert moved(after, before, "bootstrap") == 1 and moved(after, before, "fallback") == 1, after
    assert moved(after, before, "handoff") == 0, after
    refusals = [line for line in mesh.nodes["d"].log().splitlines() if "(bootstrap)" in line]
    assert refusals and "the bootstrap registry could not be asked" in refusals[-1], refusals
