"""The tail's sampler picks exactly the tokens transformers ``generate`` picks, and can catch up after failover."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer, DynamicCache, PreTrainedModel

from meshwire.limits import MIN_TEMPERATURE
from meshwire.sampling_params import SamplingParams
from services.node.sampling.sampler import Sampler, SamplingFailed
from tests.transformers_reference import reference_generate

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_dir: Path) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tokenizer("The river runs past the old mill", return_tensors="pt")["input_ids"]


def sample_with(model: PreTrainedModel, prompt: torch.Tensor, sampler: Sampler, limit: int) -> list[int]:
    """A plain KV-cached decode loop whose only choice is the sampler's."""
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    step_input = prompt
    with torch.inference_mode():
        while len(tokens) < limit:
            logits = model(input_ids=step_input, cache=cache, use_cache=True).logits[0, -1]
            token = sampler.sample(logits)
            tokens.append(token)
            if token == model.config.eos_token_id:
                break
            step_input = torch.tensor([[token]])
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=0),
        SamplingParams(temperature=0.7, seed=42),
        SamplingParams(temperature=1.3, top_k=5, seed=3),
        SamplingParams(temperature=0.9, top_p=0.8, seed=11),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=2024),
        SamplingParams(temperature=0.5, top_k=100_000, seed=5),
    ],
    ids=repr,
)
def test_sampled_tokens_equal_those_of_generate_with_the_same_seed(
    reference: PreTrainedModel, prompt_ids: torch.Tensor, params: SamplingParams
) -> None:
    expected = reference_generate(reference, prompt_ids, params, NEW_TOKENS)

    assert sample_with(reference, prompt_ids, Sampler(params), NEW_TOKENS) == expected


def test_temperature_zero_is_greedy_and_draws_nothing(
    reference: PreTrainedModel, prompt_ids: torch.Tensor
) -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, seed=9))
    out = reference.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False, max_new_tokens=20
    )

    assert sample_with(reference, prompt_ids, sampler, 20) == out[0, prompt_ids.shape[1] :].tolist()
    assert sampler.draws == 0


def test_one_draw_consumes_the_same_generator_state_whatever_the_distribution() -> None:
    vocab = 640
    peaked = torch.zeros(1, vocab)
    peaked[0, 3] = 1.0
    distributions = [
        torch.full((1, vocab), 1.0 / vocab),
        peaked,
        torch.softmax(torch.randn(1, vocab) * 8, dim=-1),
    ]
    states = []
    for probs in distributions:
        generator = torch.Generator().manual_seed(17)
        torch.multinomial(probs, 1, generator=generator)
        states.append(generator.get_state())

    assert all(torch.equal(states[0], state) for state in states[1:])


@pytest.mark.parametrize("drawn", [0, 1, 7, 25])
def test_skipping_k_draws_continues_exactly_where_sampling_after_k_draws_would(drawn: int) -> None:
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=99)
    logits = [torch.randn(640, generator=torch.Generator().manual_seed(i)) * 3 for i in range(drawn + 10)]

    original = Sampler(params)
    for step in range(drawn):
        original.sample(logits[step])
    continued = [original.sample(l) for l in logits[drawn:]]

    rebuilt = Sampler(params)
    rebuilt.skip(drawn)
    assert rebuilt.draws == drawn
    assert [rebuilt.sample(l) for l in logits[drawn:]] == continued
    assert rebuilt.draws == original.draws == drawn + 10


def test_every_sampled_token_counts_one_draw() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    for _ in range(3):
        sampler.sample(torch.randn(32))
    assert sampler.draws == 3


def test_top_k_of_one_always_picks_the_most_likely_token() -> None:
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=1, seed=4))
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert {sampler.sample(logits) for _ in range(20)} == {int(logits.argmax())}


def test_logits_must_be_a_vector() -> None:
    with pytest.raises(ValueError, match="non-empty vector"):
        Sampler(SamplingParams()).sample(torch.zeros(1, 10))


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"seed": -1},
        {"temperature": "1.0"},
        {"top_k": 2.0},
        {"min_p": 0.1},
    ],
    ids=repr,
)
def test_sampling_parameters_out_of_range_or_of_the_wrong_type_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SamplingParams.model_validate(fields)


def test_sampling_parameters_parse_from_the_wire_json() -> None:
    params = SamplingParams.model_validate_json('{"temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 12}')
    assert params == SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=12)


def test_a_temperature_between_zero_and_the_floor_is_refused() -> None:
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=1e-45)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=MIN_TEMPERATURE).temperature


def test_logits_that_cannot_be_sampled_fail_as_the_requests_fault() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    with pytest.raises(SamplingFailed, match="not finite"):
        sampler.sample(torch.tensor([float("nan"), 1.0, 2.0]))
    assert sampler.draws == 0  # nothing was drawn: a retry samples what it would have
