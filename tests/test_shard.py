"""Shards of the tiny model, chained in one process, equal transformers ``generate`` token for token."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from services.node.model.chunk_precision import (
    FLOAT32_ATTENTION,
    SDPA_ATTENTION,
    Float32ChunkLinear,
    attention_kernel,
)
from services.node.model.device import chunk_compute_dtype
from services.node.model.model_source import resolve_model
from services.node.model.shard import Shard, ShardCache, ShardError
from services.node.model.shard_load import load_shard
from services.node.sampling.sampler import Sampler, SamplingParams
from tests.transformers_reference import reference_generate

CPU = torch.device("cpu")
NEW_TOKENS = 48
"""Tokens generated per comparison (the contract asks for 40 or more)."""
PROMPT = [{"role": "user", "content": "What is the capital of France? Tell me about the river."}]


@dataclass(frozen=True)
class Hop:
    """One shard of a route and the first layer the route runs on it."""

    shard: Shard
    from_layer: int


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dir: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoded = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    return encoded["input_ids"]


@pytest.fixture(scope="module")
def shards(tiny_model_dir: Path) -> dict[tuple[int, int], Shard]:
    ranges = [(0, 3), (0, 1), (2, 3), (2, 2), (3, 3), (0, 2), (1, 3)]
    return {(a, b): load_shard(tiny_model_dir, a, b, torch.float32, CPU) for a, b in ranges}


def route(shards: dict[tuple[int, int], Shard], *ranges: tuple[int, int]) -> list[Hop]:
    """Hops for the given ranges; a range that overlaps the previous one enters after its end."""
    hops: list[Hop] = []
    for start, end in ranges:
        entry = start if not hops else max(start, hops[-1].shard.end + 1)
        hops.append(Hop(shards[(start, end)], entry))
    return hops


ROUTES: dict[str, tuple[tuple[int, int], ...]] = {
    "one shard": ((0, 3),),
    "two shards": ((0, 1), (2, 3)),
    "three shards": ((0, 1), (2, 2), (3, 3)),
    "overlapping shards": ((0, 2), (1, 3)),
}
SAMPLINGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "plain sampling": SamplingParams(temperature=1.0, seed=7),
    "temperature top-k top-p": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234),
}


def run_route(
    hops: Sequence[Hop], prompt: torch.Tensor, params: SamplingParams, limit: int, eos: int
) -> list[int]:
    """Prefill then one-token decode steps through the hops, stopping at EOS like generate."""
    caches = [hop.shard.new_cache() for hop in hops]
    sampler = Sampler(params)
    tokens: list[int] = []
    step_input, position = prompt, 0
    while len(tokens) < limit:
        hidden = hops[0].shard.embed(step_input)
        for hop, cache in zip(hops, caches):
            hidden = hop.shard.run_layers(hidden, cache, position, from_layer=hop.from_layer)
        position += step_input.shape[1]
        token = sampler.sample(hops[-1].shard.logits_last(hidden))
        tokens.append(token)
        if token == eos:
            break
        step_input = torch.tensor([[token]])
    return tokens


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("route_name", ROUTES, ids=str)
def test_a_chain_of_shards_generates_exactly_what_transformers_generates(
    shards: dict[tuple[int, int], Shard],
    reference: PreTrainedModel,
    prompt_ids: torch.Tensor,
    route_name: str,
    sampling: str,
) -> None:
    params = SAMPLINGS[sampling]
    expected = reference_generate(reference, prompt_ids, params, NEW_TOKENS)
    assert len(expected) >= 40, "the comparison must cover at least 40 tokens"

    got = run_route(
        route(shards, *ROUTES[route_name]), prompt_ids, params, NEW_TOKENS, eos=reference.config.eos_token_id
    )

    assert got == expected


def test_a_prompt_fed_in_chunks_continues_exactly_like_one_prefill(
    shards: dict[tuple[int, int], Shard], reference: PreTrainedModel, prompt_ids: torch.Tensor
) -> None:
    first, second = shards[(0, 1)], shards[(2, 3)]
    caches = [first.new_cache(), second.new_cache()]
    split = prompt_ids.shape[1] // 3
    tokens: list[int] = []
    position = 0
    for chunk in (prompt_ids[:, :split], prompt_ids[:, split:]):
        hidden = second.run_layers(
            first.run_layers(first.embed(chunk), caches[0], position), caches[1], position
        )
        position += chunk.shape[1]
    for _ in range(20):
        token = int(second.logits_last(hidden).argmax())
        tokens.append(token)
        step = torch.tensor([[token]])
        hidden = second.run_layers(
            first.run_layers(first.embed(step), caches[0], position), caches[1], position
        )
        position += 1

    assert tokens == reference_generate(reference, prompt_ids, SamplingParams(temperature=0.0), 20)


def test_a_shard_allocates_weights_only_for_the_layers_it_holds(
    shards: dict[tuple[int, int], Shard], reference: PreTrainedModel
) -> None:
    middle = shards[(2, 2)]
    reference_params = dict(reference.named_parameters())
    held = dict(middle.modules.named_parameters())

    assert held, "the middle shard holds layer 2"
    assert all(name.startswith("model.layers.2.") for name in held)
    assert set(held) == {name for name in reference_params if name.startswith("model.layers.2.")}
    assert sum(p.numel() for p in held.values()) == sum(
        p.numel() for n, p in reference_params.items() if n.startswith("model.layers.2.")
    )
    assert not any(p.is_meta for p in held.values())
    assert middle.weight_bytes() < sum(p.numel() * p.element_size() for p in reference_params.values()) / 4


def test_only_the_head_holds_the_embedding_and_only_the_tail_holds_the_lm_head(
    shards: dict[tuple[int, int], Shard],
) -> None:
    head, tail = shards[(0, 1)], shards[(2, 3)]
    head_names = set(dict(head.modules.named_parameters()))
    tail_names = set(dict(tail.modules.named_parameters()))

    assert (head.is_head, head.is_tail, tail.is_head, tail.is_tail) == (True, False, False, True)
    assert "model.embed_tokens.weight" in head_names and "lm_head.weight" not in head_names
    assert "lm_head.weight" in tail_names and "model.norm.weight" in tail_names
    assert "model.embed_tokens.weight" not in tail_names
    with pytest.raises(ShardError, match="not the head"):
        tail.embed(torch.tensor([[1, 2]]))
    with pytest.raises(ShardError, match="not the tail"):
        head.logits_last(torch.zeros(1, 1, head.hidden_size))


def test_the_kv_cache_grows_by_one_token_per_decode_step(
    shards: dict[tuple[int, int], Shard], prompt_ids: torch.Tensor
) -> None:
    shard = shards[(0, 3)]
    cache = shard.new_cache()
    assert (cache.seq_len, cache.nbytes()) == (0, 0)

    hidden = shard.run_layers(shard.embed(prompt_ids), cache, 0)
    lengths, sizes = [cache.seq_len], [cache.nbytes()]
    for _ in range(5):
        token = torch.tensor([[int(shard.logits_last(hidden).argmax())]])
        hidden = shard.run_layers(shard.embed(token), cache, cache.seq_len)
        lengths.append(cache.seq_len)
        sizes.append(cache.nbytes())

    prompt_len = prompt_ids.shape[1]
    assert lengths == list(range(prompt_len, prompt_len + 6))
    assert sizes == sorted(sizes) and sizes[0] > 0
    assert hidden.shape == (1, 1, shard.hidden_size)


def test_an_overlapping_hop_keeps_its_cache_for_the_layers_it_runs(
    shards: dict[tuple[int, int], Shard], prompt_ids: torch.Tensor
) -> None:
    first, second = shards[(0, 2)], shards[(1, 3)]
    cache_a, cache_b = first.new_cache(), second.new_cache()
    hidden = second.run_layers(
        first.run_layers(first.embed(prompt_ids), cache_a, 0), cache_b, 0, from_layer=3
    )

    assert cache_b.seq_len == prompt_ids.shape[1]
    assert cache_b.kv.get_seq_length(1) == 0 and cache_b.kv.get_seq_length(2) == 0
    with pytest.raises(ShardError, match="entered this shard at layer 3"):
        second.run_layers(hidden[:, -1:], cache_b, cache_b.seq_len, from_layer=1)


def test_a_step_that_does_not_follow_the_cache_is_refused(
    shards: dict[tuple[int, int], Shard], prompt_ids: torch.Tensor
) -> None:
    shard = shards[(0, 3)]
    cache = shard.new_cache()
    shard.run_layers(shard.embed(prompt_ids), cache, 0)

    with pytest.raises(ShardError, match="does not follow"):
        shard.run_layers(shard.embed(torch.tensor([[5]])), cache, cache.seq_len + 1)
    assert cache.seq_len == prompt_ids.shape[1]


@pytest.mark.parametrize(
    ("hidden_shape", "message"),
    [
        ((1, 3, 65), "hidden states must have shape"),
        ((2, 3, 64), "hidden states must have shape"),
        ((1, 0, 64), "n>=1"),
    ],
)
def test_hidden_states_of_the_wrong_shape_are_refused(
    shards: dict[tuple[int, int], Shard], hidden_shape: tuple[int, ...], message: str
) -> None:
    shard = shards[(2, 3)]
    with pytest.raises(ShardError, match=message):
        shard.run_layers(torch.zeros(hidden_shape), shard.new_cache(), 0)


def test_token_ids_outside_the_vocabulary_are_refused(shards: dict[tuple[int, int], Shard]) -> None:
    head = shards[(0, 1)]
    with pytest.raises(ShardError, match="token ids must be in"):
        head.embed(torch.tensor([[1, head.vocab_size]]))


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (2, 1), (0, 4), (4, 4)])
def test_a_layer_range_outside_the_model_is_refused(tiny_model_dir: Path, start: int, end: int) -> None:
    with pytest.raises(ShardError, match="not a range within the model's 4 layers"):
        load_shard(tiny_model_dir, start, end, torch.float32, CPU)


def test_a_from_layer_outside_the_shard_is_refused(shards: dict[tuple[int, int], Shard]) -> None:
    with pytest.raises(ShardError, match="outside this shard"):
        shards[(2, 3)].run_layers(torch.zeros(1, 1, 64), shards[(2, 3)].new_cache(), 0, from_layer=1)


@pytest.fixture(scope="module")
def tied_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with tied embeddings: no lm_head tensor stored, the LM head is the embedding."""
    folder = tmp_path_factory.mktemp("tiny-tied")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(folder / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_tail_of_a_tied_model_uses_the_embedding_as_its_lm_head(
    tied_model_dir: Path, prompt_ids: torch.Tensor
) -> None:
    reference = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32).eval()
    hops = [Hop(load_shard(tied_model_dir, 0, 1, torch.float32, CPU), 0)]
    hops.append(Hop(load_shard(tied_model_dir, 2, 3, torch.float32, CPU), 2))
    greedy = SamplingParams(temperature=0.0)

    got = run_route(hops, prompt_ids, greedy, 20, eos=reference.config.eos_token_id)

    assert torch.equal(
        dict(hops[1].shard.modules.named_parameters())["lm_head.weight"], reference.lm_head.weight
    )
    assert got == reference_generate(reference, prompt_ids, greedy, 20)


def test_a_reduced_precision_shard_accepts_float32_activations(
    tiny_model_dir: Path, prompt_ids: torch.Tensor
) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.bfloat16, CPU)
    cache: ShardCache = shard.new_cache()
    hidden = shard.run_layers(shard.embed(prompt_ids).float(), cache, 0)

    assert hidden.dtype == torch.bfloat16
    assert shard.logits_last(hidden).dtype == torch.float32


def greedy_tokens(shard: Shard, cache: ShardCache, prompt: torch.Tensor, count: int) -> list[int]:
    hidden = shard.run_layers(shard.embed(prompt), cache, 0)
    tokens: list[int] = []
    for _ in range(count):
        tokens.append(int(shard.logits_last(hidden).argmax()))
        hidden = shard.run_layers(shard.embed(torch.tensor([[tokens[-1]]])), cache, cache.seq_len)
    return tokens


def test_a_reserved_cache_allocates_its_reservation_once(
    shards: dict[tuple[int, int], Shard], prompt_ids: torch.Tensor
) -> None:
    shard = shards[(0, 3)]
    reserve = prompt_ids.shape[1] + 30
    cache = shard.new_cache(reserve_tokens=reserve)
    config = shard.config
    bytes_per_token = 2 * config.num_key_value_heads * config.head_dim * 4 * config.num_hidden_layers

    greedy_tokens(shard, cache, prompt_ids, 10)

    assert cache.nbytes() == reserve * bytes_per_token


def test_a_session_that_outgrows_its_cache_buffers_continues_exactly(
    shards: dict[tuple[int, int], Shard], reference: PreTrainedModel, prompt_ids: torch.Tensor
) -> None:
    shard = shards[(0, 3)]
    cache = shard.new_cache(reserve_tokens=prompt_ids.shape[1])  # full after the prompt: every step must grow

    tokens = greedy_tokens(shard, cache, prompt_ids, 30)

    assert tokens == reference_generate(reference, prompt_ids, SamplingParams(temperature=0.0), 30)
    assert cache.seq_len == prompt_ids.shape[1] + 30


def test_a_step_that_fails_midway_leaves_the_cache_as_it_was(
    shards: dict[tuple[int, int], Shard], reference: PreTrainedModel, prompt_ids: torch.Tensor
) -> None:
    shard = shards[(0, 3)]
    cache = shard.new_cache()
    hidden = shard.run_layers(shard.embed(prompt_ids), cache, 0)
    first = int(shard.logits_last(hidden).argmax())

    def fail(*_: object) -> None:
        raise RuntimeError("out of memory in layer 3")

    hook = shard.modules.model.layers["3"].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            shard.run_layers(shard.embed(torch.tensor([[first]])), cache, cache.seq_len)
    finally:
        hook.remove()

    assert [cache.kv.get_seq_length(i) for i in range(4)] == [prompt_ids.shape[1]] * 4
    tokens = [first]
    for _ in range(9):
        hidden = shard.run_layers(shard.embed(torch.tensor([[tokens[-1]]])), cache, cache.seq_len)
        tokens.append(int(shard.logits_last(hidden).argmax()))
    assert tokens == reference_generate(reference, prompt_ids, SamplingParams(temperature=0.0), 10)


def test_a_folder_that_is_not_a_model_is_refused_without_looking_elsewhere(tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="not a model folder"):
        load_shard(tmp_path / "missing", 0, 1, torch.float32, CPU)


def test_each_shard_knows_its_role_in_a_route(shards: dict[tuple[int, int], Shard]) -> None:
    assert [shards[r].role for r in [(0, 3), (0, 1), (2, 2), (2, 3)]] == ["whole", "head", "middle", "tail"]


def test_a_session_must_reserve_at_least_one_token(shards: dict[tuple[int, int], Shard]) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        shards[(0, 3)].new_cache(reserve_tokens=0)


# --- float16 shards: multi-token chunks in float32 where the CPU lacks float16 kernels -----------------

NO_NATIVE_FLOAT16 = chunk_compute_dtype(torch.float16, CPU) == torch.float32
needs_float32_chunks = pytest.mark.skipif(
    not NO_NATIVE_FLOAT16, reason="this CPU has native float16 matrix kernels: chunks stay in float16"
)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run a test on one torch thread: on a busy shared machine multi-threaded kernels stall at random."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference_f16(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float16).eval()


@pytest.fixture(scope="module")
def reference_f16_float32_attention(tiny_model_dir: Path) -> PreTrainedModel:
    """transformers float16 with its attention computed in float32, as a half-precision shard on a CPU computes it."""
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float16, attn_implementation=FLOAT32_ATTENTION
    ).eval()


@pytest.fixture(scope="module")
def shards_f16(tiny_model_dir: Path) -> dict[tuple[int, int], Shard]:
    return {r: load_shard(tiny_model_dir, *r, torch.float16, CPU) for r in [(0, 3), (0, 1), (2, 3)]}


@pytest.mark.usefixtures("one_torch_thread")
def test_float16_shards_generate_what_transformers_float16_generates(
    shards_f16: dict[tuple[int, int], Shard], reference_f16_float32_attention: PreTrainedModel,
    prompt_ids: torch.Tensor
) -> None:
    """Against transformers float16 with attention in float32, as a half-precision shard on a CPU computes it:
    with float16 attention the greedy answers part after a few dozen tokens on a CPU with native float16
    kernels (measured on an AMX Xeon), because attention rounds differently, not because a hop is wrong."""
    reference_f16 = reference_f16_float32_attention
    expected = reference_generate(reference_f16, prompt_ids, GREEDY, NEW_TOKENS)
    eos = reference_f16.config.eos_token_id

    whole = run_route(route(shards_f16, (0, 3)), prompt_ids, GREEDY, NEW_TOKENS, eos=eos)
    split = run_route(route(shards_f16, (0, 1), (2, 3)), prompt_ids, GREEDY, NEW_TOKENS, eos=eos)

    assert len(expected) >= 40
    assert whole == expected
    assert split == expected


@pytest.mark.usefixtures("one_torch_thread")
def test_a_float16_prompt_fed_in_chunks_continues_like_transformers_float16(
    shards_f16: dict[tuple[int, int], Shard], reference_f16: PreTrainedModel, prompt_ids: torch.Tensor
) -> None:
    shard = shards_f16[(0, 3)]
    cache = shard.new_cache()
    for chunk in prompt_ids.split(20, dim=1):  # 20, 20 and 13 tokens: later chunks attend to earlier ones
        hidden = shard.run_layers(shard.embed(chunk), cache, cache.seq_len)
    tokens: list[int] = []
    for _ in range(30):
        tokens.append(int(shard.logits_last(hidden).argmax()))
        hidden = shard.run_layers(shard.embed(torch.tensor([[tokens[-1]]])), cache, cache.seq_len)

    assert tokens == reference_generate(reference_f16, prompt_ids, GREEDY, 30)


@pytest.mark.usefixtures("one_torch_thread")
def test_one_token_at_a_time_a_float16_shard_computes_bit_for_bit_what_transformers_float16_computes(
    shards_f16: dict[tuple[int, int], Shard],
    reference_f16_float32_attention: PreTrainedModel,
    prompt_ids: torch.Tensor,
) -> None:
    reference_f16 = reference_f16_float32_attention
    shard = shards_f16[(0, 3)]
    cache, reference_cache = shard.new_cache(), DynamicCache(config=reference_f16.config)
    for position, token in enumerate(prompt_ids[0, :12].tolist()):
        step = torch.tensor([[token]])
        got = shard.logits_last(shard.run_layers(shard.embed(step), cache, position))
        with torch.inference_mode():
            out = reference_f16(input_ids=step, cache=reference_cache, use_cache=True)

        assert torch.equal(got, out.logits[0, -1].float()), f"decode step {position} differs"


WATCHED_KERNELS: dict[object, str] = {F.linear: "linear", F.scaled_dot_product_attention: "attention"}


class KernelFormats(TorchFunctionMode):
    """Observes, without changing anything, the format every linear and attention kernel is called in."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, torch.dtype]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in WATCHED_KERNELS:
            self.seen.add((WATCHED_KERNELS[func], args[0].dtype))
        return func(*args, **(kwargs or {}))


@needs_float32_chunks
@pytest.mark.usefixtures("one_torch_thread")
def test_a_float16_shard_on_this_cpu_runs_chunks_in_float32_and_decode_steps_linear_layers_in_float16(
    shards_f16: dict[tuple[int, int], Shard], prompt_ids: torch.Tensor
) -> None:
    shard = shards_f16[(0, 3)]
    cache = shard.new_cache()
    with KernelFormats() as prompt_kernels:
        hidden = shard.run_layers(shard.embed(prompt_ids), cache, 0)
    with KernelFormats() as decode_kernels:
        step = torch.tensor([[int(shard.logits_last(hidden).argmax())]])
        after = shard.run_layers(shard.embed(step), cache, cache.seq_len)

    assert (shard.dtype, shard.chunk_dtype) == (torch.float16, torch.float32)
    assert prompt_kernels.seen == {("linear", torch.float32), ("attention", torch.float32)}
    assert decode_kernels.seen == {("linear", torch.float16), ("attention", torch.float32)}
    assert hidden.dtype == after.dtype == torch.float16
    assert {layer.keys.dtype for layer in cache.kv.layers} == {torch.float32}  # attention's format
    assert {t.dtype for t in shard.modules.state_dict().values()} == {torch.float16}  # no float32 copies kept


@pytest.mark.parametrize(
    ("dtype", "device", "kernel"),
    [
        (torch.float16, "cpu", FLOAT32_ATTENTION),
        (torch.bfloat16, "cpu", FLOAT32_ATTENTION),
        (torch.float32, "cpu", SDPA_ATTENTION),
        (torch.float16, "cuda", SDPA_ATTENTION),
        (torch.bfloat16, "cuda", SDPA_ATTENTION),
    ],
)
def test_only_half_precision_shards_on_a_cpu_compute_attention_in_float32(
    dtype: torch.dtype, device: str, kernel: str
) -> None:
    assert attention_kernel(dtype, torch.device(device)) == kernel


def test_a_float32_shard_loads_transformers_own_attention(shards: dict[tuple[int, int], Shard]) -> None:
    assert shards[(0, 3)].config._attn_implementation == SDPA_ATTENTION


@pytest.mark.usefixtures("one_torch_thread")
def test_a_bfloat16_decode_step_computes_attention_in_float32(
    tiny_model_dir: Path, prompt_ids: torch.Tensor
) -> None:
    shard = load_shard(tiny_model_dir, 0, 3, torch.bfloat16, CPU)
    cache = shard.new_cache()
    hidden = shard.run_layers(shard.embed(prompt_ids), cache, 0)
    with KernelFormats() as decode_kernels:
        shard.run_layers(shard.embed(prompt_ids[:, -1:]), cache, cache.seq_len)

    assert ("attention", torch.float32) in decode_kernels.seen
    assert ("attention", torch.bfloat16) not in decode_kernels.seen
    assert hidden.dtype == torch.bfloat16
    # attention reads the cache in float32, so the cache keeps that format rather than convert it every step
    assert {layer.keys.dtype for layer in cache.kv.layers} == {torch.float32}


def test_float32_and_bfloat16_shards_keep_their_format_for_chunks(
    shards: dict[tuple[int, int], Shard], tiny_model_dir: Path
) -> None:
    bf16 = load_shard(tiny_model_dir, 0, 3, torch.bfloat16, CPU)

    assert shards[(0, 3)].chunk_dtype == torch.float32
    assert not any(isinstance(m, Float32ChunkLinear) for m in shards[(0, 3)].modules.modules())
    assert bf16.chunk_dtype == chunk_compute_dtype(torch.bfloat16, CPU)


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_smollm2_in_float16_answers_a_chat_prompt_like_transformers_float16_and_float32() -> None:
    path = resolve_model("default").path
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}],
        add_generation_prompt=True,
        return_tensors="pt",
    )["input_ids"]
    shard = load_shard(path, 0, 29, torch.float16, CPU)
    expected = {
        dtype: reference_generate(
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), prompt, GREEDY, 30
        )
        for dtype in (torch.float16, torch.float32)
    }

    got = run_route([Hop(shard, 0)], prompt, GREEDY, 30, eos=shard.config.eos_token_id)

    assert len(got) == 30
    assert got == expected[torch.float16] == expected[torch.float32]
