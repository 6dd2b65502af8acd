"""Structured outputs: ``response_format`` json_object and json_schema, enforced at the tail by llguidance.

The sampler tests need no processes. The mesh tests run a tracker with two
nodes splitting the tiny model (layers 0-1 and 2-3) and one node holding
every layer, serving alone; both are asked through the official client. The
tiny model's answers are random text, so every answer that parses and
validates is the grammar's doing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import jsonschema
import openai
import pytest
import torch

from meshwire.sampling_params import SamplingParams
from services.node.sampling.grammar import GrammarEngine, grammar_for_schema
from services.node.sampling.sampler import Sampler
from tests.procs import TEST_SECRET, Service, start_service
from tests.tiny_mesh import tiny_mesh
from tests.tiny_model import VOCAB_SIZE

PROMPT: Final = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA: Final = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "tags", "ok"],
    "additionalProperties": False,
}
"""Every string and array is bounded, so an answer ends well within :data:`MAX_TOKENS` whatever the model says."""
JSON_SCHEMA_FORMAT: Final = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MAX_TOKENS: Final = 200
RUNS: Final = 20
SOLO_CHUNK_TOKENS: Final = 4
"""The lone node's prompt frames: a prompt spans several, and so does an echoed prompt's scoring."""
EOS: Final = 2
"""The tiny model's ``<|im_end|>``."""


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> GrammarEngine:
    return GrammarEngine(tiny_model_dir, VOCAB_SIZE, eos_ids=(EOS,))


# --- the sampler (no processes) -------------------------------------------------------------------


def constrained_run(engine: GrammarEngine, seed: int, steps: int, start: tuple[int, ...] = ()) -> list[int]:
    """Tokens a seeded sampler picks from fixed random logits under the schema's grammar."""
    grammar = grammar_for_schema(SCHEMA)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, grammar=grammar), engine.constraint(grammar, start))
    sampler.skip(len(start))
    logits = torch.randn(steps + len(start), VOCAB_SIZE, generator=torch.Generator().manual_seed(5))
    return [sampler.pick(row).token for row in logits[len(start):]]


def test_a_grammar_rebuilt_from_the_tokens_so_far_picks_what_the_uninterrupted_sampler_picks(
        engine: GrammarEngine) -> None:
    whole = constrained_run(engine, seed=3, steps=12)
    assert constrained_run(engine, seed=3, steps=7, start=tuple(whole[:5])) == whole[5:]


def test_a_sampler_with_a_grammar_needs_its_constraint_and_a_constraint_needs_a_grammar(
        engine: GrammarEngine) -> None:
    grammar = grammar_for_schema(SCHEMA)
    with pytest.raises(ValueError, match="constraint"):
        Sampler(SamplingParams(grammar=grammar))
    with pytest.raises(ValueError, match="constraint"):
        Sampler(SamplingParams(), engine.constraint(grammar))


def test_replayed_ids_the_grammar_forbids_are_refused(engine: GrammarEngine) -> None:
    with pytest.raises(ValueError, match="does not follow the grammar"):
        engine.constraint(grammar_for_schema(SCHEMA), (2, 2, 2))


def test_a_finished_grammar_allows_only_the_end_of_sequence_token(engine: GrammarEngine) -> None:
    grammar = grammar_for_schema({"enum": ["ab"]})
    sampler = Sampler(SamplingParams(temperature=0.0, grammar=grammar), engine.constraint(grammar))
    picked = [sampler.pick(torch.zeros(VOCAB_SIZE)).token for _ in range(8)]
    assert EOS in picked and picked.index(EOS) <= len('"ab"')  # at most one token a character, then the end
    assert all(token == EOS for token in picked[picked.index(EOS):])


# --- through the mesh ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[tuple[Service, str]]:
    with tiny_mesh(tiny_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(mesh: tuple[Service, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def solo(tiny_model_dir: Path) -> Iterator[openai.OpenAI]:
    """One node holding every layer, serving alone (its head is its tail), sending prompts in small chunks."""
    node = start_service("node", {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32",
                                  "MESHNET_DEVICE": "cpu", "MESHNET_PREFILL_CHUNK_TOKENS": str(SOLO_CHUNK_TOKENS)})
    try:
        yield openai.OpenAI(base_url=f"{node.url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120)
    finally:
        node.stop()


def ask(client: openai.OpenAI, model: str, response_format: dict[str, Any], **extra: Any) -> Any:
    return client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS,
                                          response_format=response_format, **extra)  # type: ignore[arg-type]


def test_twenty_seeded_schema_runs_all_parse_and_validate(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    answers = [ask(client, mesh[1], JSON_SCHEMA_FORMAT, temperature=1.0, seed=seed) for seed in range(RUNS)]
    texts = [answer.choices[0].message.content for answer in answers]
    for answer, text in zip(answers, texts, strict=True):
        assert answer.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > RUNS // 2, "different seeds draw different answers"


def test_json_object_answers_parse_as_one_object(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    # Unbounded JSON may run past max_tokens on a random model; greedy at 0.5 it closes its object.
    for seed in range(3):
        answer = ask(client, mesh[1], {"type": "json_object"}, temperature=0.5, seed=seed)
        text = answer.choices[0].message.content
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert text.startswith("{"), text


def test_same_seed_same_answer_on_one_node_and_on_two(client: openai.OpenAI, mesh: tuple[Service, str],
                                                     solo: openai.OpenAI) -> None:
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 11}):
        two = ask(client, mesh[1], JSON_SCHEMA_FORMAT, **sampling).choices[0].message.content
        again = ask(client, mesh[1], JSON_SCHEMA_FORMAT, **sampling).choices[0].message.content
        one = ask(solo, mesh[1], JSON_SCHEMA_FORMAT, **sampling).choices[0].message.content
        assert two == again == one
        jsonschema.validate(json.loads(two), SCHEMA)


def test_a_streamed_structured_answer_equals_the_whole_one(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    whole = ask(client, mesh[1], JSON_SCHEMA_FORMAT, temperature=0.9, seed=4)
    chunks = list(ask(client, mesh[1], JSON_SCHEMA_FORMAT, temperature=0.9, seed=4, stream=True))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_of_a_structured_answer_are_those_of_the_tokens_it_allowed(
        client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    answer = ask(client, mesh[1], JSON_SCHEMA_FORMAT, temperature=0, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert b"".join(bytes(item.bytes or ()) for item in content) == answer.choices[0].message.content.encode()
    for item in content:
        assert item.logprob > -9999.0 and item.top_logprobs[0].logprob >= item.logprob


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "/nope"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
])
def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_the_problem(
        client: openai.OpenAI, mesh: tuple[Service, str], schema: dict[str, Any], problem: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, mesh[1], {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}})
    error = refused.value.body
    assert isinstance(error, dict) and problem in error["message"], error
    assert error["param"] == "response_format.json_schema.schema" and error["code"] == "invalid_schema"


@pytest.mark.parametrize(("response_format", "problem"), [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "big", "schema": {"enum": ["x" * 9000]}}}, "8192"),
])
def test_a_malformed_response_format_is_a_400(client: openai.OpenAI, mesh: tuple[Service, str],
                                             response_format: dict[str, Any], problem: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, mesh[1], response_format)
    assert problem in str(refused.value.body), refused.value.body


def test_text_format_is_free_text(client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    plain = client.chat.completions.create(model=mesh[1], messages=PROMPT, max_tokens=8, temperature=0)
    text = ask(client, mesh[1], {"type": "text"}, temperature=0)
    assert text.choices[0].message.content.startswith(plain.choices[0].message.content)


def test_an_echoed_prompt_scored_in_small_chunks_by_one_node_equals_the_two_node_mesh(
        client: openai.OpenAI, mesh: tuple[Service, str], solo: openai.OpenAI) -> None:
    prompt = "The baker opens her shop before sunrise; the smell of fresh bread drifts down the street."
    two = client.completions.create(model=mesh[1], prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    one = solo.completions.create(model=mesh[1], prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    assert one.choices[0].text == two.choices[0].text
    ones, twos = one.choices[0].logprobs, two.choices[0].logprobs
    assert ones.tokens == twos.tokens and len(ones.tokens) > 3 * SOLO_CHUNK_TOKENS
    assert all((a is None and b is None) or abs(a - b) <= 1e-4
               for a, b in zip(ones.token_logprobs, twos.token_logprobs, strict=True))


def test_the_responses_api_takes_structured_outputs_as_text_format(client: openai.OpenAI,
                                                                   mesh: tuple[Service, str]) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    response = client.responses.create(model=mesh[1], input=PROMPT[0]["content"], max_output_tokens=MAX_TOKENS,
                                       temperature=0, text={"format": fmt})  # type: ignore[typeddict-item]
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema" and response.status == "completed"
    same = ask(client, mesh[1], JSON_SCHEMA_FORMAT, temperature=0).choices[0].message.content
    assert response.output_text == same


QUOTE_TOKEN: Final = 4
"""The tiny tokenizer's ``"``: favoured, it opens a key after ``{`` where the model alone closes the object."""
KEY_BIAS: Final = 5
JSON_OBJECT_SEEDS: Final = range(6)


def test_json_object_answers_pushed_to_hold_members_parse_as_objects_with_them(
        client: openai.OpenAI, mesh: tuple[Service, str]) -> None:
    """Left to itself the tiny model answers ``json_object`` with ``{}``, which shows little: with ``"``
    favoured its objects hold members, and each answer must still be one JSON object (the grammar closes
    every string it opens and puts a ``:`` and a value after every key)."""
    with_members = 0
    for seed in JSON_OBJECT_SEEDS:
        answer = ask(client, mesh[1], {"type": "json_object"}, temperature=1.0, seed=seed,
                     logit_bias={str(QUOTE_TOKEN): KEY_BIAS})
        text = answer.choices[0].message.content
        if answer.choices[0].finish_reason == "stop":
            value = json.loads(text)
            assert isinstance(value, dict), text
            with_members += bool(value)
        else:
            assert text.startswith('{"'), text
    assert with_members >= len(JSON_OBJECT_SEEDS) // 2, "the bias gives most answers members to check"
