"""The default model served as its GGUF's own 4-bit blocks (``--weights auto``): memory, logits, answers.

Slow: it loads SmolLM2-135M-Instruct three times. The two halves of a 2-node
int4 mesh each hold at most 70 MB; the int4 logits equal a float reference
computed from the same dequantized values (products rounded as the kernel
rounds them) within :data:`LOGITS_RTOL`; greedy answers agree with the
float32 mesh's on at least 18 of 20 prompts, and the capital of France is
still Paris (the int4 shards as ``--dtype auto`` runs them: float32 between
the packed products; measured 19 of 20 at 8 tokens, 16 with a bfloat16
residual stream).
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.node.model.model_source import ResolvedModel, resolve_model
from services.node.model.quant.packed import QUANTIZED_DTYPE
from services.node.model.quant.quant_load import resolve_format
from services.node.model.shard import Shard
from services.node.model.shard_load import load_shard
from tests.procs import Service, start_service, wait_healthy
from tests.test_quant import _float_reference
from tests.tiny_mesh import wait_until_servable

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
MAX_NODE_WEIGHT_BYTES = 70_000_000
"""The issue's bound on each node of a 2-node int4 mesh."""
LOGITS_RTOL = 0.05
"""int4 logits against the rounding-matched float reference, relative to the logits' magnitude."""
ANSWER_TOKENS = 8
REAL_MODEL_READY_S = 600.0
"""How long two nodes may take to load the default model (its first conversion included) on a loaded machine."""
MIN_AGREEING = 18
PROMPTS = (
    "What is the capital of France?", "What is the capital of Japan?", "What is 2 + 2?",
    "What color is the sky on a clear day?", "How many days are in a week?", "What is the largest planet?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?", "What is H2O?",
    "How many legs does a spider have?", "What is the opposite of hot?", "What language is spoken in Spain?",
    "What is the capital of Italy?", "What do bees make?", "How many continents are there?",
    "What is the freezing point of water in Celsius?", "What animal says moo?", "What is 10 times 10?",
    "What is the capital of Germany?", "Which ocean is the largest?",
)


@pytest.fixture(scope="module")
def model() -> ResolvedModel:
    return resolve_model("default")


@pytest.fixture(scope="module")
def tokenizer(model: ResolvedModel) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model.path)


def greedy(shards: Sequence[Shard], ids: torch.Tensor, tokens: int) -> list[int]:
    caches = [shard.new_cache() for shard in shards]
    out: list[int] = []
    for _ in range(tokens):
        offset = caches[0].seq_len
        hidden = shards[0].embed(ids)
        for shard, cache in zip(shards, caches, strict=True):
            hidden = shard.run_layers(hidden, cache, offset)
        out.append(int(shards[-1].logits_last(hidden).argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def test_auto_serves_the_default_gguf_as_int4_and_each_half_holds_at_most_70_mb(model: ResolvedModel) -> None:
    assert model.gguf is not None and resolve_format("auto", model.gguf)[0] == "int4"
    for start, end in ((0, 14), (15, 29)):
        shard = load_shard(model.path, start, end, QUANTIZED_DTYPE, CPU, "int4", model.gguf)
        assert shard.weights_format == "int4"
        assert shard.weight_bytes() <= MAX_NODE_WEIGHT_BYTES


def test_int4_logits_equal_a_float_reference_of_the_same_dequantized_values(
        model: ResolvedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    quantized = load_shard(model.path, 0, 29, torch.float32, CPU, "int4", model.gguf)
    reference = _float_reference(model.path, quantized)
    ids = prompt_ids(tokenizer, PROMPTS[0])
    logits = [shard.logits_last(shard.run_layers(shard.embed(ids), shard.new_cache(), 0))
              for shard in (quantized, reference)]
    assert (logits[0] - logits[1]).abs().max() <= LOGITS_RTOL * logits[1].abs().max()


def test_greedy_int4_answers_agree_with_the_float_mesh_and_paris_is_still_the_capital(
        model: ResolvedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    float_mesh = [load_shard(model.path, 0, 14, torch.float32, CPU), load_shard(model.path, 15, 29, torch.float32, CPU)]
    int4_mesh = [load_shard(model.path, 0, 14, QUANTIZED_DTYPE, CPU, "int4", model.gguf),
                 load_shard(model.path, 15, 29, QUANTIZED_DTYPE, CPU, "int4", model.gguf)]
    answers = []
    for question in PROMPTS:
        ids = prompt_ids(tokenizer, question)
        answers.append((greedy(float_mesh, ids, ANSWER_TOKENS), greedy(int4_mesh, ids, ANSWER_TOKENS)))
    agreeing = sum(a == b for a, b in answers)
    disagreeing = [(PROMPTS[i], tokenizer.decode(a), tokenizer.decode(b))
                   for i, (a, b) in enumerate(answers) if a != b]
    assert agreeing >= MIN_AGREEING, disagreeing
    assert "Paris" in tokenizer.decode(answers[0][1])


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_16_bit_kv_cache_takes_half_the_bytes_and_keeps_the_greedy_answers(
        model: ResolvedModel, tokenizer: PreTrainedTokenizerBase, kv_dtype: str) -> None:
    """``--kv-dtype``: int4 shards keeping their KV cache in 16 bits answer as with the float32 cache (all 20
    prompts measured for both formats; the bound is the issue's 18)."""
    exact = [load_shard(model.path, 0, 14, QUANTIZED_DTYPE, CPU, "int4", model.gguf),
             load_shard(model.path, 15, 29, QUANTIZED_DTYPE, CPU, "int4", model.gguf)]
    half = [load_shard(model.path, 0, 14, QUANTIZED_DTYPE, CPU, "int4", model.gguf, kv_dtype),
            load_shard(model.path, 15, 29, QUANTIZED_DTYPE, CPU, "int4", model.gguf, kv_dtype)]
    ids = prompt_ids(tokenizer, PROMPTS[0])
    caches = [shard.new_cache(64) for shard in (exact[0], half[0])]
    for shard, cache in zip((exact[0], half[0]), caches, strict=True):
        shard.run_layers(shard.embed(ids), cache, 0)
    layer = caches[1].kv.layers[0]
    assert layer.keys.dtype == layer.values.dtype == getattr(torch, kv_dtype)
    assert caches[1].nbytes() * 2 == caches[0].nbytes()
    answers = []
    for question in PROMPTS:
        ids = prompt_ids(tokenizer, question)
        answers.append((greedy(exact, ids, ANSWER_TOKENS), greedy(half, ids, ANSWER_TOKENS)))
    disagreeing = [(PROMPTS[i], tokenizer.decode(a), tokenizer.decode(b))
                   for i, (a, b) in enumerate(answers) if a != b]
    assert len(answers) - len(disagreeing) >= MIN_AGREEING, disagreeing
    assert "Paris" in tokenizer.decode(answers[0][1])
    print(f"{kv_dtype} KV: {len(answers) - len(disagreeing)} of {len(answers)} greedy answers as with float32 KV")


def test_a_float_shard_keeps_its_own_kv_format_and_says_so(model: ResolvedModel,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="services.node.model.shard"):
        shard = load_shard(model.path, 0, 1, torch.float32, CPU, "float", None, "float16")
    assert shard.kv_dtype in (None, torch.float32)
    assert "--kv-dtype float16 applies to quantized weights only" in caplog.text


MESH_AGREEING = 19
"""The README's stated share for the int4 mesh served by real nodes: 19 of 20 prompts at 8 tokens."""


def test_a_real_two_node_int4_mesh_answers_as_the_float_mesh_on_the_stated_share_of_prompts(
        model: ResolvedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Two ``meshnet node`` processes serving the default GGUF as it ships (``--weights auto``: int4, the native
    kernel where it builds), behind a tracker, asked through the OpenAI API: greedy answers equal the float32
    shards' on the README's 19 of 20 prompts, and France's capital is Paris."""
    float_mesh = [load_shard(model.path, 0, 14, torch.float32, CPU), load_shard(model.path, 15, 29, torch.float32, CPU)]
    eos = set(tokenizer.all_special_ids)
    expected = []
    for question in PROMPTS:
        ids = greedy(float_mesh, prompt_ids(tokenizer, question), ANSWER_TOKENS)
        ended = next((i for i, token in enumerate(ids) if token in eos), len(ids))
        expected.append(tokenizer.decode(ids[:ended], skip_special_tokens=True))
    del float_mesh
    services: list[Service] = []
    try:
        tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": "1"})
        services.append(tracker)
        for node_id, layers in (("int4-front", "0-14"), ("int4-back", "15-29")):
            services.append(start_service("node", {
                "MESHNET_LAYERS": layers, "MESHNET_TRACKER": tracker.url, "MESHNET_NODE_ID": node_id,
                "MESHNET_DEVICE": "cpu", "MESHNET_HEARTBEAT_S": "1"}, wait_ready=False))
        for node in services[1:]:
            wait_healthy(node, REAL_MODEL_READY_S)
        registered = {n["node_id"]: n for n in httpx.get(f"{tracker.url}/v1/nodes", timeout=30).json()["nodes"]}
        assert {registered[name]["weights"] for name in ("int4-front", "int4-back")} == {"int4"}, registered
        client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=300)
        name = wait_until_servable(tracker, "SmolLM2-135M-Instruct")
        answers = [client.chat.completions.create(model=name, messages=[{"role": "user", "content": question}],
                                                  max_tokens=ANSWER_TOKENS, temperature=0).choices[0].message.content
                   for question in PROMPTS]
    finally:
        for service in reversed(services):
            service.stop()
    disagreeing = [(PROMPTS[i], want, got) for i, (want, got) in enumerate(zip(expected, answers, strict=True))
                   if want != got]
    assert len(PROMPTS) - len(disagreeing) >= MESH_AGREEING, disagreeing
    assert "Paris" in answers[0]
