"""A draft model on the head (``--draft-model``): it drafts, the tail verifies, the answer does not change.

In process: a draft session proposes what the model picks greedily, keeps its
KV cache in step with the verified conversation (a rejected draft's rows are
cropped), is bounded and freed; a draft model whose vocabulary is not the
served model's is refused with a message that says so.

Across processes (the tiny model, float32): three heads of layers 0-1 and one
tail (2-3). ``self`` drafts with the tiny model itself (its drafts are what the
route computes, so nearly all are accepted), ``other`` with a tiny model of
another seed and the same tokenizer (its drafts are mostly rejected), ``plain``
does not speculate. Greedy output is the same from all three, token for token,
and equals transformers; a node given a draft model of another vocabulary does
not start, and says why.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from meshwire import headers as h
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from services.node.engine.compute import ComputeWorker
from services.node.head.draft_model import DraftModelError, load_draft_model
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    named_nodes,
    node_hop_key,
    pinned_node_env,
    start_service,
)
from tests.tiny_model import build_tiny_model

NUM_LAYERS = 4
LAYERS = {"self": (0, 1), "other": (0, 1), "plain": (0, 1), "back": (2, 3)}
OTHER_SEED = 7
PROMPTS = (
    [{"role": "user", "content": "Repeat this line twice: the river runs past the old mill and under the stone bridge."}],
    [{"role": "user", "content": "Where does the river run before it reaches the sea?"}],
)
MAX_TOKENS = 40
EXIT_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's architecture and tokenizer with other random weights: a draft model that drafts badly."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-other"), seed=OTHER_SEED)


@pytest.fixture(scope="module")
def foreign_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model with one more token in its tokenizer: ids that no longer mean the served model's tokens."""
    folder = tmp_path_factory.mktemp("tiny-foreign")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, folder / item.name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<|not-in-the-served-model|>"])
    tokenizer.save_pretrained(folder)
    return folder


def _vocabulary(folder: Path) -> dict[str, int]:
    return dict(AutoTokenizer.from_pretrained(folder).get_vocab())


# --- in process ----------------------------------------------------------------------------------------------


def _greedy(reference: PreTrainedModel, tokens: list[int], k: int) -> list[int]:
    out = reference.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                             do_sample=False, max_new_tokens=k, min_new_tokens=k)
    return out[0, len(tokens):].tolist()


def test_a_draft_session_proposes_the_greedy_continuation_and_follows_the_verified_tokens(
        tiny_model_dir: Path, reference: PreTrainedModel) -> None:
    worker = ComputeWorker(1)
    try:
        model = load_draft_model(tiny_model_dir, _vocabulary(tiny_model_dir), worker)
        session = model.session()
        assert session is not None and model.open_sessions == 1

        async def go() -> None:
            tokens = list(range(20, 45))
            first = await session.propose(tokens, 4)
            assert list(first) == _greedy(reference, tokens, 4)
            # Two drafts accepted, then the tail's own (different) token: the cache keeps the verified prefix only.
            verified = [*tokens, *first[:2], (first[2] + 1) % 600]
            again = await session.propose(verified, 3)
            assert list(again) == _greedy(reference, verified, 3)
            assert session.held == len(verified) + 2  # the verified tokens, then the drafts fed back but the last
            # A conversation that differs early (a new route's history is the same; this one is not): still right.
            fresh = [*tokens[:5], 99, 98, 97]
            assert list(await session.propose(fresh, 2)) == _greedy(reference, fresh, 2)

        asyncio.run(go())
        session.close()
        session.close()
        assert model.open_sessions == 0
        assert asyncio.run(session.propose([1, 2, 3], 2)) == ()  # closed: nothing
    finally:
        worker.shutdown()


def test_draft_sessions_are_bounded_in_number_and_length(tiny_model_dir: Path) -> None:
    worker = ComputeWorker(1)
    try:
        model = load_draft_model(tiny_model_dir, _vocabulary(tiny_model_dir), worker)
        model.max_sessions, model.max_context = 2, 16
        first, second = model.session(), model.session()
        assert first is not None and second is not None and model.session() is None
        assert asyncio.run(first.propose(list(range(15)), 2)) == ()  # 15 + 2 positions > 16
        assert len(asyncio.run(first.propose(list(range(10)), 2))) == 2
        first.close()
        assert model.session() is not None
    finally:
        worker.shutdown()


def test_a_draft_model_of_another_vocabulary_is_refused_naming_why(tiny_model_dir: Path,
                                                                   foreign_model_dir: Path) -> None:
    worker = ComputeWorker(1)
    try:
        with pytest.raises(DraftModelError, match="vocabulary"):
            load_draft_model(foreign_model_dir, _vocabulary(tiny_model_dir), worker)
        with pytest.raises(DraftModelError, match="not a folder"):
            load_draft_model(tiny_model_dir / "missing", _vocabulary(tiny_model_dir), worker)
    finally:
        worker.shutdown()


# --- across processes ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nodes(tiny_model_dir: Path, other_model_dir: Path) -> Iterator[dict[str, Service]]:
    common = {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu"}
    extra = {
        "self": {"MESHNET_SPECULATE": "on", "MESHNET_SPECULATE_MAX": "4", "MESHNET_DRAFT_MODEL": str(tiny_model_dir)},
        "other": {"MESHNET_SPECULATE": "on", "MESHNET_SPECULATE_MAX": "4",
                  "MESHNET_DRAFT_MODEL": str(other_model_dir)},
        "plain": {"MESHNET_SPECULATE": "off"},
    }
    with named_nodes(LAYERS, common, extra) as started:
        yield started


def _model(nodes: dict[str, Service], head: str) -> str:
    return str(httpx.get(f"{nodes[head].url}/health").json()["model"])


def _client(nodes: dict[str, Service], head: str) -> openai.OpenAI:
    model = _model(nodes, head)
    hops = [RouteNode(node_id=name, endpoint=nodes[name].url, shard_start=LAYERS[name][0], shard_end=LAYERS[name][1],
                      start_layer=LAYERS[name][0], hop_key=node_hop_key(name).public_text) for name in (head, "back")]
    token = sign_route(Route(model=model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS), TEST_ROUTE_KEY)
    return openai.OpenAI(base_url=f"{nodes[head].url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120,
                         default_headers={h.ROUTE: token})


def _counter(service: Service, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{service.url}/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def _reference_text(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    messages: list[dict[str, str]]) -> str:
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = reference.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return str(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:].tolist(), skip_special_tokens=True))


def test_greedy_output_with_a_draft_model_equals_output_without_and_transformers(
        nodes: dict[str, Service], reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    before = {head: (_counter(nodes[head], "meshnet_node_drafted_tokens_total"),
                     _counter(nodes[head], "meshnet_node_accepted_tokens_total")) for head in ("self", "other")}
    for messages in PROMPTS:
        expected = _reference_text(reference, tokenizer, messages)
        for head in ("self", "other", "plain"):
            answer = _client(nodes, head).chat.completions.create(
                model=_model(nodes, head), messages=messages, max_tokens=MAX_TOKENS, temperature=0)  # type: ignore[arg-type]
            assert answer.choices[0].message.content == expected, head
    acceptance = {}
    for head, (drafted, accepted) in before.items():
        drafted = _counter(nodes[head], "meshnet_node_drafted_tokens_total") - drafted
        accepted = _counter(nodes[head], "meshnet_node_accepted_tokens_total") - accepted
        assert drafted > 0, head
        acceptance[head] = accepted / drafted
    assert acceptance["self"] >= 0.9  # the route computes what the draft model does (float32 rounding aside)
    assert acceptance["other"] <= 0.5  # other weights guess other tokens
    assert _counter(nodes["plain"], "meshnet_node_drafted_tokens_total") == 0


def test_a_node_given_a_draft_model_of_another_vocabulary_does_not_start(tiny_model_dir: Path,
                                                                         foreign_model_dir: Path) -> None:
    node = start_service("node", {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32",
                                  "MESHNET_DEVICE": "cpu", "MESHNET_DRAFT_MODEL": str(foreign_model_dir),
                                  **pinned_node_env("foreign")}, wait_ready=False)
    try:
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while node.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not node.alive(), "the node started with a draft model of another vocabulary"
        assert "cannot draft for this model" in node.log()
    finally:
        node.stop()
