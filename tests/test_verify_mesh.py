"""Spot checks with real processes (issue 37): a node that computes wrong is caught, routed around, and shown.

A tracker with ``MESHNET_VERIFY_RATE=1`` (every route names a shadow), a head for layers 0-1 (speculating
whenever prompt lookup has a draft) and honest
replicas ``r1`` and ``r2`` of layers 2-3, all float32 with batching on. Honest replicas compared on every
step of mixed batched and lone, greedy and seeded chats never disagree. Then ``bad``, a third replica of 2-3
with ``--fault corrupt-output:1.0``, joins: within 40 greedy chats sent 8 at a time it is quarantined (with
the reason and the receipts, in ``GET /v1/nodes``), no honest node is, every answer after equals
transformers, and a request started on the head directly along a route planned before the quarantine moves off
``bad`` at its next step. A forged or replayed receipt report is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire import headers as h
from meshwire.auth import bearer_headers
from meshwire.frames import encode_frame
from meshwire.receipts import RECEIPT, answer_digest, make_receipt, parse_receipt, sha256_hex
from meshwire.route_keys import SigningKey
from meshwire.row_batch import CONTENT_TYPE, decode_answers, encode_rows
from services.node.settings import ALLOW_FAULTS_ENV
from tests.failover_mesh import wait_for
from tests.procs import TEST_SECRET, Service, node_hop_key, start_service
from tests.verify_views import (
    chat,
    chat_until_quarantined,
    checking_mesh,
    live_nodes,
    quarantined,
    served_model,
    verify_checks,
)

LAYERS: Final = {"head": (0, 1), "r1": (2, 3), "r2": (2, 3)}
PROMPTS: Final = ["Where does the river run?", "Name a colour.", "Tell me about the sea.", "Count to five."]
MAX_TOKENS: Final = 8
ROUNDS: Final = 5
AT_ONCE: Final = 8
SEEDED: Final = {"temperature": 0.8, "seed": 3}
TIMEOUT_S: Final = 120.0


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    def node_env(tracker: Service) -> dict[str, str]:
        return {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
                "MESHNET_TRACKER": tracker.url, "MESHNET_THREADS": "1"}

    # speculative steps too: drafts verified by the tail and its shadow
    with checking_mesh(node_env, LAYERS, {"head": {"MESHNET_SPECULATE": "on"}}, TIMEOUT_S) as services:
        yield {**services, "_common": node_env(services["tracker"])}  # type: ignore[dict-item]


def _chat(tracker: Service, prompt: str, sampling: dict[str, Any] | None = None) -> str:
    return chat(tracker, prompt, MAX_TOKENS, TIMEOUT_S, sampling)


def _expected(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = reference.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:].tolist(), skip_special_tokens=True)


def _node_metric(node: Service, name: str, **labels: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{node.url}/metrics", timeout=30).text)
    return sum(sample.value for family in families for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def test_honest_replicas_checked_on_every_step_never_disagree(mesh: dict[str, Service]) -> None:
    tracker = mesh["tracker"]
    jobs = [(prompt, sampling) for prompt in PROMPTS for sampling in (None, SEEDED)] * 2
    with ThreadPoolExecutor(AT_ONCE) as pool:  # batched: 8 sessions step together on each node
        batched = list(pool.map(lambda job: _chat(tracker, *job), jobs))
    lone = [_chat(tracker, prompt, sampling) for prompt, sampling in jobs[:4]]  # one session at a time
    assert lone == batched[:4]
    wait_for(lambda: verify_checks(tracker).get("agree", 0) >= len(jobs) * 2, "the heads' receipt reports", TIMEOUT_S)
    assert verify_checks(tracker).get("disagree", 0) == 0
    families = text_string_to_metric_families(httpx.get(f"{mesh['head'].url}/metrics", timeout=30).text)
    speculative = sum(sample.value for family in families for sample in family.samples
                      if sample.name == "meshnet_node_decode_steps_total" and sample.labels["speculative"] == "true")
    assert speculative > 0, "speculative steps were checked too"
    view = live_nodes(tracker)
    assert all(not view[name]["quarantined"] and view[name]["disputes"] == [] for name in LAYERS)


def _frame(route: str, session: str, ask: bool) -> tuple[dict[str, str], bytes]:
    hidden = torch.randn((1, 2, 64), generator=torch.Generator().manual_seed(len(session)))
    return encode_frame(hidden, session=session, extra={
        h.ROUTE: route, h.HOP_INDEX: "1", h.START_LAYER: "2", h.STEP: "0", h.POSITION_OFFSET: "0",
        h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}',
        **({h.RECEIPTS: "chain"} if ask else {})})


def test_a_hop_returns_receipts_in_its_answer_only_to_a_sender_that_asks_one_per_row(
        mesh: dict[str, Service]) -> None:
    """A sender older than receipts (no ``X-Meshnet-Receipts``) gets the answer it always got (it refuses unknown
    fields); one that asks gets the chain, and each row of a batch carries its own receipt."""
    tracker = mesh["tracker"]
    route = httpx.get(f"{tracker.url}/v1/route", params={"model": served_model(tracker)}, timeout=30).json()
    token, tail = route["token"], route["nodes"][1]["node_id"]
    url = mesh[tail].url
    headers, body = _frame(token, "wire-old", ask=False)
    old = httpx.post(f"{url}/forward", headers={**headers, **bearer_headers(TEST_SECRET)}, content=body, timeout=30)
    assert old.status_code == 200 and "receipts" not in old.json() and RECEIPT in old.headers
    headers, body = _frame(token, "wire-new", ask=True)
    new = httpx.post(f"{url}/forward", headers={**headers, **bearer_headers(TEST_SECRET)}, content=body, timeout=30)
    assert new.status_code == 200 and new.json()["receipts"] == [new.headers[RECEIPT]]
    rows = [_frame(token, f"wire-row-{i}", ask=True) for i in range(3)]
    batch = httpx.post(f"{url}/forward/rows", content=encode_rows(rows), timeout=30,
                       headers={h.WIRE: h.WIRE_VERSION, h.ROUTE: token, h.HOP_INDEX: "1",
                                "Content-Type": CONTENT_TYPE, **bearer_headers(TEST_SECRET)})
    assert batch.status_code == 200, batch.text
    answers = decode_answers(batch.content, len(rows))
    sessions = []
    for (_, row_body), answer in zip(rows, answers, strict=True):
        assert answer.status == 200, answer.body
        (receipt,) = [parse_receipt(text) for text in answer.body["receipts"]]
        assert receipt.fields.input_sha256 == sha256_hex(row_body)
        assert receipt.fields.output_sha256 == answer_digest([answer.body["token"]])
        sessions.append(receipt.fields.session)
    assert sessions == ["wire-row-0", "wire-row-1", "wire-row-2"]


def test_a_forged_or_replayed_receipt_report_is_refused(mesh: dict[str, Service]) -> None:
    tracker = mesh["tracker"]
    route = httpx.get(f"{tracker.url}/v1/route", params={"model": served_model(tracker)}, timeout=30).json()
    token, tail = route["token"], route["nodes"][1]["node_id"]

    def receipt(key: SigningKey, step: int) -> str:
        return make_receipt(key, route_token=token, session="verify-test", node_id=tail, hop_index=1, step=step,
                            position_offset=step, positions=1, input_sha256=sha256_hex(b"in"),
                            output_sha256=answer_digest([1])).encode()

    def report(*receipts: str) -> httpx.Response:
        return httpx.post(f"{tracker.url}/v1/receipts", json={"route": token, "receipts": list(receipts)},
                          headers=bearer_headers(TEST_SECRET), timeout=30)

    forged = report(receipt(SigningKey.generate(), 0))
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "bad_receipt", forged.text
    honest = receipt(node_hop_key(tail), 1)
    assert report(honest).status_code == 200
    replayed = report(honest)
    assert replayed.status_code == 403 and "replay" in replayed.json()["error"]["message"]
    unsigned_route = httpx.post(f"{tracker.url}/v1/receipts", json={"route": "a.b.c", "receipts": [honest]},
                                headers=bearer_headers(TEST_SECRET), timeout=30)
    assert unsigned_route.status_code == 403


def test_a_node_that_computes_wrong_is_quarantined_and_routed_around(
        mesh: dict[str, Service], tiny_model_dir: Path, reference: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase) -> None:
    tracker = mesh["tracker"]
    common: dict[str, str] = mesh["_common"]  # type: ignore[assignment]
    bad = start_service("node", {**common, "MESHNET_NODE_ID": "bad", "MESHNET_LAYERS": "2-3",
                                 "MESHNET_NODE_KEY": node_hop_key("bad").seed_text,
                                 "MESHNET_FAULT": "corrupt-output:1.0", ALLOW_FAULTS_ENV: "1"})
    try:
        wait_for(lambda: "bad" in live_nodes(tracker), "the faulty replica to register", TIMEOUT_S)
        through_bad = httpx.get(f"{tracker.url}/v1/route", params={"model": served_model(tracker), "exclude": "r1,r2"},
                                timeout=30).json()["token"]  # planned before the quarantine, still valid after it
        chat_until_quarantined(tracker, "bad", PROMPTS, rounds=ROUNDS,  # 40 greedy chats, 8 at a time
                               at_once=AT_ONCE, max_tokens=MAX_TOKENS, timeout_s=TIMEOUT_S)
        assert quarantined(tracker) == {"bad"}, "no honest node is ever quarantined"
        shown = live_nodes(tracker)["bad"]
        assert "agree with each other" in shown["quarantine"]["reason"] and shown["quarantine"]["receipts"]
        assert verify_checks(tracker).get("disagree", 0) > 0
        summary = httpx.get(f"{tracker.url}/v1/verify", timeout=30).json()
        assert set(summary["quarantined"]) == {"bad"} and summary["receipts_kept"] > 0
        with ThreadPoolExecutor(AT_ONCE) as pool:
            after = list(pool.map(lambda i: _chat(tracker, PROMPTS[i % len(PROMPTS)]), range(AT_ONCE)))
        assert after == [_expected(reference, tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(AT_ONCE)]
        # A stream started on the head directly (not through the tracker) along a route naming the quarantined
        # node leaves it at its next step, once the head's heartbeat answer has named it.
        head = mesh["head"]
        wait_for(lambda: _node_metric(head, "meshnet_node_quarantined_known") >= 1, "the head to hear of it",
                 TIMEOUT_S)
        body = {"model": served_model(tracker), "messages": [{"role": "user", "content": PROMPTS[0]}],
                "max_tokens": MAX_TOKENS, "temperature": 0}
        direct = httpx.post(f"{head.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S,
                            headers={h.ROUTE: through_bad, **bearer_headers(TEST_SECRET)})
        assert direct.status_code == 200, direct.text
        assert direct.json()["choices"][0]["message"]["content"] == _expected(reference, tokenizer, PROMPTS[0])
        assert _node_metric(head, "meshnet_node_failovers_total", reason="quarantined", outcome="moved") >= 1
        for _ in range(8):
            route = httpx.get(f"{tracker.url}/v1/route", params={"model": served_model(tracker)}, timeout=30).json()
            assert "bad" not in {hop["node_id"] for hop in route["nodes"]}
            assert route.get("shadow") is None or route["shadow"]["node"]["node_id"] != "bad"
        readmitted = httpx.post(f"{tracker.url}/v1/admin/nodes/bad/readmit", headers=bearer_headers(TEST_SECRET),
                                timeout=30)
        assert readmitted.status_code == 200, readmitted.text
        assert not live_nodes(tracker)["bad"]["quarantined"]
        assert httpx.post(f"{tracker.url}/v1/admin/nodes/bad/readmit", timeout=30).status_code == 401
    finally:
        bad.stop()
