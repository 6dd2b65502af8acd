"""What the verification tests read from a tracker, and the chats they drive it with (tests/test_verify_*mesh.py).

One place for a checking mesh's start (a tracker at verify rate 1 and its nodes), the tracker's views (its live nodes, the quarantined ones, the checks counted by outcome) and for
the must-hold's load: greedy chats sent ``at_once`` at a time until a named node is quarantined.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.failover_mesh import wait_for
from tests.procs import Service, node_hop_key, start_service, start_together

VIEW_TIMEOUT_S = 30.0
"""Bound on one read of the tracker's node list or metrics."""
CHECKING_TRACKER_ENV = {"MESHNET_VERIFY_RATE": "1.0", "MESHNET_NODE_TTL_S": "30", "MESHNET_HEARTBEAT_S": "1"}
"""A tracker that checks every route it plans, with quick heartbeats."""


@contextlib.contextmanager
def checking_mesh(node_env: Callable[[Service], dict[str, str]], layers: dict[str, tuple[int, int]],
                  extra: dict[str, dict[str, str]], timeout_s: float) -> Iterator[dict[str, Service]]:
    """A checking tracker and one node a name of ``layers`` (its own id, range and hop key over
    ``node_env(tracker)``, plus ``extra[name]``), started together; yields them by name (the tracker as
    ``"tracker"``) once every node has registered, and stops them all after."""
    tracker = start_service("tracker", CHECKING_TRACKER_ENV)
    common = node_env(tracker)
    specs = {name: {**common, "MESHNET_NODE_ID": name, "MESHNET_LAYERS": f"{a}-{b}",
                    "MESHNET_NODE_KEY": node_hop_key(name).seed_text, **extra.get(name, {})}
             for name, (a, b) in layers.items()}
    try:
        started = dict(zip(specs, start_together([("node", spec) for spec in specs.values()]), strict=True))
    except Exception:
        tracker.stop()
        raise
    services = {"tracker": tracker, **started}
    try:
        wait_for(lambda: set(layers) <= set(live_nodes(tracker)), "every node to register", timeout_s)
        yield services
    finally:
        for service in services.values():
            service.stop()


def live_nodes(tracker: Service) -> dict[str, dict[str, Any]]:
    """The tracker's ``GET /v1/nodes`` by node id, offline nodes left out."""
    listed = httpx.get(f"{tracker.url}/v1/nodes", timeout=VIEW_TIMEOUT_S).json()["nodes"]
    return {node["node_id"]: node for node in listed if node["state"] != "offline"}


def served_model(tracker: Service) -> str:
    return next(iter(live_nodes(tracker).values()))["model"]


def chat(tracker: Service, prompt: str, max_tokens: int, timeout_s: float,
         sampling: dict[str, Any] | None = None) -> str:
    """One chat through the tracker (greedy unless ``sampling`` says otherwise); its text, after a 200."""
    body = {"model": served_model(tracker), "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, **(sampling or {"temperature": 0})}
    answer = httpx.post(f"{tracker.url}/v1/chat/completions", json=body, timeout=timeout_s)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["message"]["content"])


def verify_checks(tracker: Service) -> dict[str, float]:
    """``meshnet_verify_checks_total`` by outcome."""
    families = text_string_to_metric_families(httpx.get(f"{tracker.url}/metrics", timeout=VIEW_TIMEOUT_S).text)
    return {sample.labels["outcome"]: sample.value for family in families for sample in family.samples
            if sample.name == "meshnet_verify_checks_total"}


def quarantined(tracker: Service) -> set[str]:
    return {name for name, node in live_nodes(tracker).items() if node.get("quarantined")}


def chat_until_quarantined(tracker: Service, node_id: str, prompts: Sequence[str], *, rounds: int, at_once: int,
                           max_tokens: int, timeout_s: float) -> None:
    """Up to ``rounds`` rounds of ``at_once`` greedy chats at a time, stopping once ``node_id`` is quarantined;
    then wait (within ``timeout_s``) for it, since the last round's receipts may still be on their way."""
    for _ in range(rounds):
        with ThreadPoolExecutor(at_once) as pool:
            list(pool.map(lambda i: chat(tracker, prompts[i % len(prompts)], max_tokens, timeout_s),
                          range(at_once)))
        if node_id in quarantined(tracker):
            return
    wait_for(lambda: node_id in quarantined(tracker), f"{node_id}'s quarantine", timeout_s)
