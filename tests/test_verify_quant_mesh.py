"""Spot checks of a hop before the tail, with real processes (issue 37): batch-invariant quantized hops.

A tiny Q8_0 GGUF served packed with float32 rows: a head for layers 0-1, three replicas of the MIDDLE layer 2
(``m1``, ``m2`` and ``bad``, the last with ``--fault corrupt-output:1.0``) and one tail for layer 3, a tracker
with ``MESHNET_VERIFY_RATE=1`` and batching on. The tail has no replica, so every check is of the middle hop's
hidden states by exact hash: fair only because its quantized products are batch-invariant (each replica batches
a session's row with other company; ``tests/test_rows_exact.py``), which the nodes register (``rows_exact``).
Within 40 greedy chats sent 8 at a time ``bad`` is quarantined, no honest node ever is (the honest middle
replicas agree on every step they are compared on, speculative steps included where there are any), and every answer after equals
transformers on the file's weights (the reference of the GGUF tests). The same with three replicas of the head's layers (``h1``, ``h2``,
``hbad``) and one tail: a head sends its shadow each step's token ids and signs a receipt of its own step.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import pytest

from services.node.model.quant import quant_kernel
from services.node.settings import ALLOW_FAULTS_ENV
from tests.failover_mesh import wait_for
from tests.gguf_mesh import Served, reference, serve_family
from tests.procs import Service
from tests.requirements import needs
from tests.verify_views import (
    chat,
    chat_until_quarantined,
    checking_mesh,
    live_nodes,
    quarantined,
    verify_checks,
)

LAYERS: Final = {"head": (0, 1), "m1": (2, 2), "m2": (2, 2), "bad": (2, 2), "tail": (3, 3)}
HEAD_LAYERS: Final = {"h1": (0, 1), "h2": (0, 1), "hbad": (0, 1), "tail": (2, 3)}
PROMPTS: Final = ["Where does the river run?", "Tell me about the sea.", "Count to five."]
MAX_TOKENS: Final = 8
ROUNDS: Final = 5
AT_ONCE: Final = 8
TIMEOUT_S: Final = 120.0

pytestmark = needs(quant_kernel.available(), "meshnet's native kernel did not build here (a C++ compiler)")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return serve_family("llama", tmp_path_factory.mktemp("verify-q8"), "Q8_0")


def _mesh(served: Served, layers: dict[str, tuple[int, int]], bad: str) -> Iterator[dict[str, Service]]:
    """A tracker checking every route and nodes holding ``layers`` of the GGUF, ``bad`` corrupting every output."""
    def node_env(tracker: Service) -> dict[str, str]:
        # speculative steps too, where prompt lookup has a draft (how many varies with what the faulty replica
        # answered first, so none is required): a draft's frame is compared as any other
        return {"MESHNET_MODEL": str(served.gguf.path), "MESHNET_MODEL_CACHE_DIR": str(served.cache),
                "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu", "MESHNET_TRACKER": tracker.url,
                "MESHNET_THREADS": "1", "MESHNET_SPECULATE": "on"}

    with checking_mesh(node_env, layers, {bad: {"MESHNET_FAULT": "corrupt-output:1.0", ALLOW_FAULTS_ENV: "1"}},
                       TIMEOUT_S) as services:
        yield services


@pytest.fixture
def mesh(served: Served) -> Iterator[dict[str, Service]]:
    yield from _mesh(served, LAYERS, "bad")


@pytest.fixture
def head_mesh(served: Served) -> Iterator[dict[str, Service]]:
    yield from _mesh(served, HEAD_LAYERS, "hbad")


def _chat(tracker: Service, prompt: str) -> str:
    return chat(tracker, prompt, MAX_TOKENS, TIMEOUT_S)


def _expected(served: Served, prompt: str) -> str:
    ids = served.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
    return served.tokenizer.decode(reference(served, None, MAX_TOKENS, ids), skip_special_tokens=True)


def test_a_middle_replica_that_computes_wrong_is_quarantined_and_honest_ones_agree(
        mesh: dict[str, Service], served: Served) -> None:
    tracker = mesh["tracker"]
    view = live_nodes(tracker)
    paths = {name: view[name]["rows_exact"] for name in LAYERS}
    assert paths["m1"] is not None and paths["m1"] == paths["m2"] == paths["bad"], paths
    chat_until_quarantined(tracker, "bad", PROMPTS, rounds=ROUNDS, at_once=AT_ONCE,  # 40 greedy chats, 8 at a time
                           max_tokens=MAX_TOKENS, timeout_s=TIMEOUT_S)
    assert quarantined(tracker) == {"bad"}, "no honest node is ever quarantined"
    view = live_nodes(tracker)
    assert "agree with each other" in view["bad"]["quarantine"]["reason"]
    assert view["m1"]["disputes"] in ([], ["bad"]) and view["m2"]["disputes"] in ([], ["bad"])
    checks = verify_checks(tracker)
    assert checks.get("agree", 0) > 0 and checks.get("disagree", 0) > 0
    with ThreadPoolExecutor(AT_ONCE) as pool:
        after = list(pool.map(lambda i: _chat(tracker, PROMPTS[i % len(PROMPTS)]), range(AT_ONCE)))
    assert after == [_expected(served, PROMPTS[i % len(PROMPTS)]) for i in range(AT_ONCE)]
    agreed = verify_checks(tracker).get("agree", 0)
    with ThreadPoolExecutor(AT_ONCE) as pool:  # m1 and m2 shadow each other now: batched, they still agree
        list(pool.map(lambda i: _chat(tracker, PROMPTS[i % len(PROMPTS)]), range(AT_ONCE)))
    wait_for(lambda: verify_checks(tracker).get("agree", 0) > agreed, "the honest replicas' comparisons", TIMEOUT_S)
    assert quarantined(tracker) == {"bad"}
    assert "m2" not in live_nodes(tracker)["m1"]["disputes"]


def test_a_head_that_computes_wrong_is_quarantined_and_honest_heads_agree(
        head_mesh: dict[str, Service], served: Served) -> None:
    """The head's own layers: three replicas of 0-1, one corrupting what it sends on. A head sends its shadow
    (another head) each step's token ids and signs a receipt of its own step; honest quantized heads agree."""
    tracker = head_mesh["tracker"]
    chat_until_quarantined(tracker, "hbad", PROMPTS, rounds=ROUNDS, at_once=AT_ONCE,  # 40 greedy chats, 8 at a time
                           max_tokens=MAX_TOKENS, timeout_s=TIMEOUT_S)
    assert quarantined(tracker) == {"hbad"}, "no honest node is ever quarantined"
    view = live_nodes(tracker)
    assert "agree with each other" in view["hbad"]["quarantine"]["reason"]
    assert view["h1"]["disputes"] in ([], ["hbad"]) and view["h2"]["disputes"] in ([], ["hbad"])
    with ThreadPoolExecutor(AT_ONCE) as pool:
        after = list(pool.map(lambda i: _chat(tracker, PROMPTS[i % len(PROMPTS)]), range(AT_ONCE)))
    assert after == [_expected(served, PROMPTS[i % len(PROMPTS)]) for i in range(AT_ONCE)]
    assert quarantined(tracker) == {"hbad"}
