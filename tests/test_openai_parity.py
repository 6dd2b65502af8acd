"""OpenAI parity through the official client: log-probabilities, logit_bias, and nothing silently ignored.

A real tracker and two nodes splitting the tiny model in float32; the
reference is single-process transformers on the same folder.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from meshwire.sampling_params import SamplingParams
from services.node.head.tokens import HeadTokenizer
from services.node.sampling.sampler import Sampler
from tests.procs import Service
from tests.tiny_mesh import tiny_mesh

PROMPT: Final = [{"role": "user", "content": "Where does the river run?"}]
MAX_TOKENS: Final = 10
TOLERANCE: Final = 1e-4
"""Largest difference allowed between a reported log-probability and transformers' (float32)."""


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[tuple[Service, str]]:
    with tiny_mesh(tiny_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh: tuple[Service, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def reference_steps(reference: tuple[PreTrainedModel, PreTrainedTokenizerBase], limit: int,
                    bias: dict[int, float] | None = None) -> list[tuple[int, torch.Tensor]]:
    """Greedy decoding in transformers: each step's token and the log-softmax of its (biased) logits."""
    model, tokenizer = reference
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    tokens = ids["input_ids"]
    steps = []
    with torch.inference_mode():
        for _ in range(limit):
            logits = model(tokens).logits[0, -1].float()
            for token, value in (bias or {}).items():
                logits[token] += value
            token = int(logits.argmax())
            steps.append((token, torch.log_softmax(logits, dim=-1)))
            tokens = torch.cat([tokens, torch.tensor([[token]])], dim=1)
    return steps


def chat(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    return client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS,
                                          **{"temperature": 0, **extra})


# --- the sampler (no processes) -------------------------------------------------------------------


def test_the_sampler_reports_log_softmax_of_the_biased_logits_and_bias_steers_greedy_choice() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    plain = Sampler(SamplingParams(temperature=0.0, logprobs=3)).pick(logits)
    assert plain.token == best and plain.logprobs is not None
    expected = torch.log_softmax(logits, dim=-1)
    assert math.isclose(plain.logprobs.logprob, float(expected[best]), abs_tol=1e-6)
    assert [token for token, _ in plain.logprobs.top] == expected.topk(3).indices.tolist()
    banned = Sampler(SamplingParams(temperature=0.0, logit_bias=((best, -100.0),))).pick(logits)
    assert banned.token != best and banned.logprobs is None


def test_seeded_sampling_with_logprobs_draws_the_same_tokens_as_without() -> None:
    """Asking for log-probabilities never changes which tokens a seeded session draws."""
    rows = [torch.randn(40, generator=torch.Generator().manual_seed(i)) for i in range(20)]
    plain = Sampler(SamplingParams(temperature=0.9, seed=5))
    told = Sampler(SamplingParams(temperature=0.9, seed=5, logprobs=2))
    assert [plain.pick(row).token for row in rows] == [told.pick(row).token for row in rows]


# --- through the mesh -------------------------------------------------------------------------------


def test_chat_logprobs_equal_transformers_log_softmax_streamed_or_not(
        client: openai.OpenAI, mesh: tuple[Service, str], reference: Any) -> None:
    answer = chat(client, mesh[1], logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    steps = reference_steps(reference, len(content))
    assert len(content) >= 1
    for item, (token, logprobs) in zip(content, steps, strict=True):
        assert abs(item.logprob - float(logprobs[token])) <= TOLERANCE
        assert bytes(item.bytes).decode("utf-8", errors="backslashreplace") == item.token
        top_ids = logprobs.topk(2).indices.tolist()
        assert [abs(alt.logprob - float(logprobs[i])) <= TOLERANCE for alt, i in zip(item.top_logprobs, top_ids,
                                                                                      strict=True)] == [True, True]
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=TOLERANCE)  # greedy: the likeliest
    text = b"".join(bytes(item.bytes) for item in content).decode("utf-8", errors="replace")
    assert text == answer.choices[0].message.content  # the tokens' bytes are the answer's

    streamed = client.chat.completions.create(model=mesh[1], messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True)
    chunks = [item for chunk in streamed for choice in chunk.choices if choice.logprobs
              for item in choice.logprobs.content or ()]
    assert [(c.token, c.logprob) for c in chunks] == [(c.token, c.logprob) for c in content]


def test_without_logprobs_the_answer_carries_none(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    assert chat(client, mesh[1]).choices[0].logprobs is None


def test_completion_logprobs_have_the_legacy_shape(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    answer = client.completions.create(model=mesh[1], prompt="The river", max_tokens=6, temperature=0, logprobs=2)
    legacy = answer.choices[0].logprobs
    assert legacy is not None and len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) >= 1
    assert all(len(top) <= 2 and lp <= 0 for top, lp in zip(legacy.top_logprobs, legacy.token_logprobs, strict=True))
    assert legacy.text_offset[0] == 0


def test_logit_bias_bans_the_greedy_token_and_equals_transformers_with_the_same_bias(
        client: openai.OpenAI, mesh: tuple[Service, str], reference: Any) -> None:
    first = reference_steps(reference, 1)[0][0]
    bias = {first: -100.0}
    answer = chat(client, mesh[1], logit_bias={str(first): -100}, logprobs=True)
    content = answer.choices[0].logprobs.content
    steps = reference_steps(reference, len(content), bias)
    _, tokenizer = reference
    assert answer.choices[0].message.content == tokenizer.decode([token for token, _ in steps],
                                                                 skip_special_tokens=True)
    assert all(abs(item.logprob - float(lp[token])) <= TOLERANCE
               for item, (token, lp) in zip(content, steps, strict=True))
    assert all(token != first for token, _ in steps)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
    ({"top_logprobs": 2}, None),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
])
def test_what_the_mesh_does_not_do_is_a_400_naming_it(client: openai.OpenAI, mesh: tuple[Service, str],
                                                      extra: dict[str, Any], param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, mesh[1], **extra)
    error = refused.value.body
    assert isinstance(error, dict)
    named = param or "top_logprobs"
    assert named in error["message"], error
    if param is not None:
        assert error.get("param") == param, error


def test_completions_refuse_suffix_and_best_of(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    for extra, name in (({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=mesh[1], prompt="The river", max_tokens=4, **extra)
        assert name in str(refused.value.body), refused.value.body


def test_user_store_and_metadata_are_accepted_without_effect(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    plain = chat(client, mesh[1]).choices[0].message.content
    tagged = chat(client, mesh[1], user="u-1", store=False, metadata={"team": "a"}).choices[0].message.content
    assert plain == tagged


# --- echo ----------------------------------------------------------------------------------------

ECHO_PROMPT: Final = "The river runs past the old mill and under the stone bridge"


def test_echo_gives_the_prompt_back_before_the_completion(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    plain = client.completions.create(model=mesh[1], prompt=ECHO_PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=mesh[1], prompt=ECHO_PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == ECHO_PROMPT + plain.choices[0].text
    assert echoed.usage == plain.usage


def test_echoed_prompt_logprobs_equal_transformers_and_streamed_equals_whole(
        client: openai.OpenAI, mesh: tuple[Service, str],
        reference: tuple[PreTrainedModel, PreTrainedTokenizerBase]) -> None:
    model, tokenizer = reference
    prompt = tokenizer(ECHO_PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = torch.log_softmax(model(prompt).logits[0].float(), dim=-1)
    whole = client.completions.create(model=mesh[1], prompt=ECHO_PROMPT, max_tokens=4, temperature=0, echo=True,
                                      logprobs=2)
    logprobs = whole.choices[0].logprobs
    count = prompt.shape[1]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, count):
        token = int(prompt[0, position])
        assert abs(logprobs.token_logprobs[position] - float(expected[position - 1, token])) <= TOLERANCE
        assert len(logprobs.top_logprobs[position]) == 2
    assert len(logprobs.tokens) == count + whole.usage.completion_tokens
    assert "".join(logprobs.tokens[:count]) == ECHO_PROMPT
    assert logprobs.text_offset[count] == len(ECHO_PROMPT)
    streamed = list(client.completions.create(model=mesh[1], prompt=ECHO_PROMPT, max_tokens=4, temperature=0,
                                              echo=True, logprobs=2, stream=True))
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text
    tokens = [token for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
              for token in chunk.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens


# --- tools ------------------------------------------------------------------------------------------

WEATHER: Final = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_for_a_template_without_tool_support_are_a_400_that_says_so(
        client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        extra = {} if choice is None else {"tool_choice": choice}
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client, mesh[1], tools=[WEATHER], **extra)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "tools", error
        assert "chat template has no tool support" in error["message"], error


def test_tool_choice_none_answers_as_if_no_tools_were_offered(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    plain = chat(client, mesh[1])
    answer = chat(client, mesh[1], tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content == plain.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None


def test_a_template_supports_tools_when_it_renders_them(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not HeadTokenizer(tokenizer, (2,)).supports_tools
    tokenizer.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}" + str(tokenizer.chat_template)
    assert HeadTokenizer(tokenizer, (2,)).supports_tools


# --- n > 1 -----------------------------------------------------------------------------------------


def test_n_choices_are_each_the_one_choice_answer_with_seed_plus_index(client: openai.OpenAI,
                                                                     mesh: tuple[Service, str]) -> None:
    several = chat(client, mesh[1], n=3, temperature=0.9, seed=5)
    singles = [chat(client, mesh[1], temperature=0.9, seed=5 + index) for index in range(3)]
    assert [choice.index for choice in several.choices] == [0, 1, 2]
    assert [choice.message.content for choice in several.choices] == \
        [single.choices[0].message.content for single in singles]
    assert len({choice.message.content for choice in several.choices}) > 1, "each choice draws its own tokens"
    assert several.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert several.usage.completion_tokens == sum(single.usage.completion_tokens for single in singles)
    assert chat(client, mesh[1], n=3, temperature=0.9, seed=5).choices == several.choices, "reproducible"


def test_n_streamed_choices_carry_their_index_under_one_id_and_equal_the_whole_answer(
        client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    whole = chat(client, mesh[1], n=2, temperature=0.9, seed=8, logprobs=True)
    chunks = list(chat(client, mesh[1], n=2, temperature=0.9, seed=8, logprobs=True, stream=True,
                       stream_options={"include_usage": True}))
    texts = ["", ""]
    finishes: list[str | None] = [None, None]
    tokens: list[list[str]] = [[], []]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
            tokens[choice.index] += [item.token for item in (choice.logprobs.content or ())] if choice.logprobs else []
    assert len({chunk.id for chunk in chunks}) == 1
    assert texts == [choice.message.content for choice in whole.choices]
    assert finishes == [choice.finish_reason for choice in whole.choices]
    assert tokens == [[item.token for item in choice.logprobs.content] for choice in whole.choices]
    usage_chunks = [chunk for chunk in chunks if chunk.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1].usage == whole.usage and chunks[-1].choices == []


def test_completions_take_n_too(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    answer = client.completions.create(model=mesh[1], prompt="The river", max_tokens=6, n=2, temperature=0.9,
                                       seed=2)
    single = client.completions.create(model=mesh[1], prompt="The river", max_tokens=6, temperature=0.9, seed=3)
    assert [choice.index for choice in answer.choices] == [0, 1]
    assert answer.choices[1].text == single.choices[0].text


# --- the Responses API -------------------------------------------------------------------------------


def test_responses_create_answers_what_the_same_chat_answers(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    response = client.responses.create(model=mesh[1], input=PROMPT[0]["content"], max_output_tokens=MAX_TOKENS,
                                       temperature=0)
    chat_text = chat(client, mesh[1]).choices[0].message.content
    assert response.output_text == chat_text
    assert response.status in ("completed", "incomplete") and response.usage is not None
    assert response.usage.output_tokens <= MAX_TOKENS and response.usage.input_tokens > 0


def test_responses_instructions_are_the_system_message(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    response = client.responses.create(model=mesh[1], instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": PROMPT[0]["content"]}]}],
        max_output_tokens=MAX_TOKENS, temperature=0)
    same = client.chat.completions.create(model=mesh[1], max_tokens=MAX_TOKENS, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *PROMPT])
    assert response.output_text == same.choices[0].message.content


def test_a_streamed_response_has_the_event_sequence_and_the_same_text(
        client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    whole = client.responses.create(model=mesh[1], input="The river", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model=mesh[1], input="The river", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_responses_refuse_what_they_cannot_do_by_name(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    for extra, name in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"tools": [{"type": "web_search"}]}, "tools"),
                        ({"reasoning": {"effort": "high"}}, "reasoning"),
                        ({"extra_body": {"frobnicate": 1}}, "frobnicate")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=mesh[1], input="hi", max_output_tokens=4, **extra)
        assert name in str(refused.value.body), refused.value.body
