"""``n > 1`` from one prefill (``meshwire.fork``): the choices share their prompt's KV and still equal
``n`` separate seeded requests, token for token.

A real tracker and two nodes splitting the tiny model in float32; the official client. A second mesh serves
a tiny Qwen2 whose last two layers are sliding-window layers, which cannot be forked (a window keeps only its
last tokens): the node holding them refuses every fork, so each follower falls back to a prefill of its own,
and the metrics and the head's log show it did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from meshwire.sampling_params import SamplingParams
from tests import tiny_model
from tests.procs import Service, start_service, wait_healthy
from tests.tiny_mesh import HEARTBEAT_S, wait_until_servable
from tests.transformers_reference import reference_generate

PROMPT: Final = [{"role": "user", "content": "Where does the river run, and why?"}]
NODES: Final = (("front-node", "0-1"), ("back-node", "2-3"))
N: Final = 3


class Mesh:
    def __init__(self, tracker: Service, nodes: dict[str, Service], model: str) -> None:
        self.tracker, self.nodes, self.model = tracker, nodes, model
        self.client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def metric(self, node: str, sample: str, **labels: str) -> float:
        total = 0.0
        for family in text_string_to_metric_families(httpx.get(f"{self.nodes[node].url}/metrics").text):
            for s in family.samples:
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += float(s.value)
        return total

    def counts(self) -> dict[str, tuple[float, float, float]]:
        """Per node: positions computed, positions copied by forks, forks refused."""
        return {name: (self.metric(name, "meshnet_node_positions_computed_total"),
                       self.metric(name, "meshnet_node_fork_positions_total"),
                       self.metric(name, "meshnet_node_forks_total", outcome="refused")) for name in self.nodes}


@contextlib.contextmanager
def started_mesh(model_dir: Path, speculate: str) -> Iterator[Mesh]:
    tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_STORE": "memory"})
    nodes: dict[str, Service] = {}
    try:
        for node_id, layers in NODES:
            nodes[node_id] = start_service("node", {
                "MESHNET_MODEL": str(model_dir), "MESHNET_LAYERS": layers, "MESHNET_TRACKER": tracker.url,
                "MESHNET_NODE_ID": node_id, "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
                "MESHNET_HEARTBEAT_S": HEARTBEAT_S, "MESHNET_SPECULATE": speculate}, wait_ready=False)
        for node in nodes.values():
            wait_healthy(node)
        yield Mesh(tracker, nodes, wait_until_servable(tracker, model_dir.name))
    finally:
        for service in [*nodes.values(), tracker]:
            service.stop()


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[Mesh]:
    with started_mesh(tiny_model_dir, "off") as running:
        yield running


@pytest.fixture(scope="module")
def speculating(tiny_model_dir: Path) -> Iterator[Mesh]:
    with started_mesh(tiny_model_dir, "on") as running:
        yield running


def chat(mesh: Mesh, **extra: Any) -> Any:
    return mesh.client.chat.completions.create(model=mesh.model, messages=PROMPT, **{"max_tokens": 8, **extra})


def streamed_texts(chunks: list[Any], n: int, *, chat_api: bool) -> list[str]:
    texts = [""] * n
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if chat_api else choice.text
    return texts


def test_n_seeded_chat_choices_equal_separate_requests_and_the_prompt_runs_once(mesh: Mesh) -> None:
    before = mesh.counts()
    several = chat(mesh, n=N, temperature=0.9, seed=5, logprobs=True)
    middle = mesh.counts()
    singles = [chat(mesh, temperature=0.9, seed=5 + index, logprobs=True) for index in range(N)]
    after = mesh.counts()
    assert [c.message.content for c in several.choices] == [s.choices[0].message.content for s in singles]
    assert [[t.token for t in c.logprobs.content] for c in several.choices] == \
        [[t.token for t in s.choices[0].logprobs.content] for s in singles]
    assert len({c.message.content for c in several.choices}) > 1, "each choice draws its own tokens"
    prompt = several.usage.prompt_tokens
    for name in mesh.nodes:
        forked = middle[name][0] - before[name][0]
        alone = after[name][0] - middle[name][0]
        copied = middle[name][1] - before[name][1]
        assert middle[name][2] == before[name][2], f"{name} refused no fork"
        assert copied == (N - 1) * (prompt - 1), f"{name} copied the prompt's rows for every follower"
        assert forked == alone - (N - 1) * (prompt - 1), f"{name} ran the prompt once, one position per follower"


def test_n_streamed_chat_and_completions_equal_separate_requests(mesh: Mesh) -> None:
    chunks = list(chat(mesh, n=N, temperature=0.8, seed=11, stream=True))
    singles = [chat(mesh, temperature=0.8, seed=11 + index).choices[0].message.content for index in range(N)]
    assert streamed_texts(chunks, N, chat_api=True) == singles
    kwargs: dict[str, Any] = {"model": mesh.model, "prompt": "The river runs to the sea because", "max_tokens": 8,
                              "temperature": 0.9}
    answer = mesh.client.completions.create(n=N, seed=3, **kwargs)
    streamed = list(mesh.client.completions.create(n=N, seed=3, stream=True, **kwargs))
    alone = [mesh.client.completions.create(seed=3 + index, **kwargs).choices[0].text for index in range(N)]
    assert [choice.text for choice in answer.choices] == alone
    assert streamed_texts(streamed, N, chat_api=False) == alone


def test_n_greedy_choices_with_structured_output_equal_one_answer(mesh: Mesh) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"river": {"type": "string"}}, "required": ["river"]}}}
    several = chat(mesh, n=N, temperature=0.7, seed=2, response_format=fmt)
    singles = [chat(mesh, temperature=0.7, seed=2 + i, response_format=fmt) for i in range(N)]
    assert [c.message.content for c in several.choices] == [s.choices[0].message.content for s in singles]


def test_a_fork_whose_source_is_gone_falls_back_to_a_prefill_and_still_equals(mesh: Mesh) -> None:
    """``max_tokens=1``: the first choice ends (and closes its session) as soon as its prompt is in, so the
    others' forks may find it gone at the head or on a hop; whichever way, every choice equals its request."""
    def outcomes() -> float:
        return sum(mesh.metric("front-node", "meshnet_node_forks_total", outcome=o) for o in ("forked", "refused"))

    before = outcomes()
    for seed in range(4):
        several = mesh.client.chat.completions.create(model=mesh.model, messages=PROMPT, max_tokens=1, n=N,
                                          temperature=0.9, seed=seed)
        singles = [mesh.client.chat.completions.create(model=mesh.model, messages=PROMPT, max_tokens=1,
                                                       temperature=0.9, seed=seed + i) for i in range(N)]
        assert [c.message.content for c in several.choices] == [s.choices[0].message.content for s in singles]
    assert outcomes() - before == 4 * (N - 1), "every follower forked or fell back to a prefill"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_with_speculation_on_the_choices_still_equal_separate_requests(speculating: Mesh,
                                                                      temperature: float) -> None:
    before = speculating.counts()
    several = chat(speculating, n=N, temperature=temperature, seed=7, max_tokens=12)
    copied = {name: speculating.counts()[name][1] - before[name][1] for name in speculating.nodes}
    singles = [chat(speculating, temperature=temperature, seed=7 + i, max_tokens=12) for i in range(N)]
    assert [c.message.content for c in several.choices] == [s.choices[0].message.content for s in singles]
    assert all(value == (N - 1) * (several.usage.prompt_tokens - 1) for value in copied.values()), copied


# --- a node that cannot fork: every follower falls back to a prefill ------------------------------------

SLIDING_WINDOW: Final = tiny_model.MAX_POSITIONS
"""As long as the model's context: the sliding layers attend as full ones do (transformers' answers are the
same), but their cache is a sliding window, which a fork cannot copy."""
FULL_LAYERS: Final = 2
"""Layers 0-1 (the front node's) are full attention, 2-3 (the back node's) sliding."""
COMPLETION_PROMPT: Final = "The river runs to the sea because"


def build_sliding_model(tiny: Path, dest: Path) -> Path:
    """A tiny Qwen2 with the tiny model's tokenizer whose layers from :data:`FULL_LAYERS` on slide."""
    config = Qwen2Config(
        vocab_size=tiny_model.VOCAB_SIZE, hidden_size=tiny_model.HIDDEN_SIZE,
        intermediate_size=tiny_model.INTERMEDIATE_SIZE, num_hidden_layers=tiny_model.NUM_LAYERS,
        num_attention_heads=tiny_model.NUM_HEADS, num_key_value_heads=tiny_model.NUM_KV_HEADS,
        max_position_embeddings=tiny_model.MAX_POSITIONS, initializer_range=tiny_model.INIT_STD,
        use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=FULL_LAYERS,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    assert config.layer_types == ["full_attention"] * FULL_LAYERS + ["sliding_attention"] * FULL_LAYERS
    torch.manual_seed(tiny_model.SEED)
    Qwen2ForCausalLM(config).eval().save_pretrained(dest)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def sliding_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sliding_model(tiny_model_dir, tmp_path_factory.mktemp("sliding") / "tiny-sliding")


@pytest.fixture(scope="module")
def unforkable(sliding_dir: Path) -> Iterator[Mesh]:
    with started_mesh(sliding_dir, "off") as running:
        yield running


def test_a_node_that_cannot_fork_makes_every_follower_prefill_and_the_choices_equal_transformers(
        unforkable: Mesh, sliding_dir: Path) -> None:
    mesh = unforkable
    before = mesh.counts()
    answer = mesh.client.completions.create(model=mesh.model, prompt=COMPLETION_PROMPT, max_tokens=8, n=N,
                                            temperature=0.9, seed=3)
    after = mesh.counts()
    for name in mesh.nodes:  # (positions computed, positions copied by forks, forks refused)
        assert after[name][1] == before[name][1], f"{name} copied no prompt: no fork went through"
        assert after[name][2] - before[name][2] == N - 1, f"{name} counted every follower's fork refused"
    prompt = answer.usage.prompt_tokens
    computed = {name: after[name][0] - before[name][0] for name in mesh.nodes}
    assert all(value >= N * prompt for value in computed.values()), ("every choice ran its prompt", computed)
    refusals = [line for line in mesh.nodes["front-node"].log().splitlines()
                if "could not fork the first choice's prompt" in line]
    assert len(refusals) >= N - 1 and "back-node cannot fork" in refusals[-1], refusals

    reference: PreTrainedModel = AutoModelForCausalLM.from_pretrained(sliding_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(sliding_dir)
    ids = torch.tensor([tokenizer(COMPLETION_PROMPT).input_ids])
    assert ids.shape[1] == prompt
    expected = [tokenizer.decode(reference_generate(reference, ids, SamplingParams(temperature=0.9, seed=3 + i), 8),
                                 skip_special_tokens=True) for i in range(N)]
    assert [choice.text for choice in answer.choices] == expected
    assert len(set(expected)) > 1, "each choice draws its own tokens"
