"""The OpenAI front door over a real mesh: one tracker and two nodes splitting the tiny model.

Everything here goes through the official ``openai`` client (or raw HTTP where
the wire itself is the point: ``[DONE]``, a forged route header).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from meshwire.route_keys import SigningKey
from meshwire.routes import Route, RouteNode, sign_route
from tests.procs import Service
from tests.tiny_mesh import tiny_mesh
from tests.tiny_model import MAX_POSITIONS

PROMPT = [{"role": "user", "content": "Where does the river run?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["memory", "redis"])
def mesh(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Service, str]]:
    """A tracker and two nodes (layers 0-1 and 2-3), and the model's registered name, once servable.

    Once with the memory store and once with a real Redis (``MESHNET_STORE``).
    """
    store = "memory" if request.param == "memory" else request.getfixturevalue("redis_url")
    with tiny_mesh(tiny_model_dir, store) as running:
        yield running


@pytest.fixture
def client(mesh: tuple[Service, str]) -> openai.OpenAI:
    tracker, _ = mesh
    return openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def model_name(tiny_model_dir: Path) -> str:
    """The name a user types: the model folder's basename."""
    return tiny_model_dir.name


def greedy_chat(client: openai.OpenAI, model: str, **extra: Any) -> str:
    answer = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            **extra)
    return answer.choices[0].message.content or ""


# --- chat ---------------------------------------------------------------------------------------------------


def test_a_chat_completion_answers_with_text_and_usage(client: openai.OpenAI, model_name: str) -> None:
    answer = client.chat.completions.create(model=model_name, messages=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.prompt_tokens > 0
    assert 0 < answer.usage.completion_tokens <= MAX_TOKENS
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_streamed_chat_arrives_in_several_content_chunks_then_done(mesh: tuple[Service, str],
                                                                     model_name: str) -> None:
    tracker, _ = mesh
    body = {"model": model_name, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{tracker.url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    contents = [e for e in events[:-1] if '"content"' in e]
    assert len(contents) >= 2


def test_a_streamed_chat_says_what_the_unstreamed_one_says(client: openai.OpenAI, model_name: str) -> None:
    stream = client.chat.completions.create(model=model_name, messages=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == greedy_chat(client, model_name)


def test_a_stream_asked_for_usage_ends_with_a_usage_chunk(client: openai.OpenAI, model_name: str) -> None:
    chunks = list(client.chat.completions.create(model=model_name, messages=PROMPT, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens > 0 and 0 < last.usage.completion_tokens <= MAX_TOKENS
    assert all(chunk.usage is None for chunk in chunks[:-1])


# --- completions ----------------------------------------------------------------------------------------------


def test_a_text_completion_answers_with_text_and_usage(client: openai.OpenAI, model_name: str) -> None:
    answer = client.completions.create(model=model_name, prompt="The river runs", max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert isinstance(answer.choices[0].text, str)
    assert answer.usage is not None and 0 < answer.usage.completion_tokens <= MAX_TOKENS


def test_a_streamed_text_completion_says_what_the_unstreamed_one_says(client: openai.OpenAI,
                                                                      model_name: str) -> None:
    whole = client.completions.create(model=model_name, prompt="The river runs", max_tokens=MAX_TOKENS,
                                      temperature=0).choices[0].text
    stream = client.completions.create(model=model_name, prompt="The river runs", max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == whole


# --- models and the mesh ---------------------------------------------------------------------------------------


def test_models_lists_the_served_model_by_its_registered_name(client: openai.OpenAI,
                                                              mesh: tuple[Service, str]) -> None:
    assert [card.id for card in client.models.list()] == [mesh[1]]


def test_a_model_is_retrieved_by_its_basename(client: openai.OpenAI, model_name: str,
                                              mesh: tuple[Service, str]) -> None:
    assert client.models.retrieve(model_name).id == mesh[1]


def test_each_node_is_listed_with_its_layers_state_and_load(mesh: tuple[Service, str]) -> None:
    tracker, model = mesh
    listing = httpx.get(f"{tracker.url}/v1/nodes").json()
    nodes = {node["node_id"]: node for node in listing["nodes"]}
    assert (nodes["front-node"]["shard_start"], nodes["front-node"]["shard_end"]) == (0, 1)
    assert (nodes["back-node"]["shard_start"], nodes["back-node"]["shard_end"]) == (2, 3)
    for node in nodes.values():
        assert node["state"] in ("joining", "online") and node["kv_capacity_tokens"] > 0
        assert node["endpoint"].startswith("http://127.0.0.1:")
    (coverage,) = listing["models"]
    assert coverage["model"] == model and coverage["complete"] and coverage["missing"] == []


# --- what a client must not be able to do ----------------------------------------------------------------------


def test_a_route_header_sent_by_the_client_has_no_effect(client: openai.OpenAI, model_name: str,
                                                          mesh: tuple[Service, str]) -> None:
    tracker, model = mesh
    elsewhere = RouteNode(node_id="front-node", endpoint="http://127.0.0.1:9", shard_start=0, shard_end=3,
                          start_layer=0)
    forged = sign_route(Route(model=model, nodes=(elsewhere,), num_layers=4), SigningKey.generate())
    expected = greedy_chat(client, model_name)
    assert greedy_chat(client, model_name, extra_headers={"X-Meshnet-Route": forged}) == expected
    raw = httpx.post(f"{tracker.url}/v1/chat/completions", timeout=120,
                     headers={"X-Meshnet-Route": "garbage", "x-meshnet-route": "more-garbage"},
                     json={"model": model_name, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert raw.status_code == 200 and raw.json()["choices"][0]["message"]["content"] == expected


def test_an_unknown_model_is_404_even_with_a_mesh_running(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=PROMPT)


def test_a_prompt_longer_than_the_models_context_is_400_context_length_exceeded(client: openai.OpenAI,
                                                                                model_name: str) -> None:
    """The tiny model's context (4,096 positions) is below the node's prompt limit (8,192 tokens): the model's
    own context is what bounds the prompt, and the refusal names it."""
    long_text = " ".join(f"w{i}" for i in range(MAX_POSITIONS))  # several tokens a word: past the context
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model_name, prompt=long_text, max_tokens=1, temperature=0)
    body = error.value.body
    assert isinstance(body, dict) and body.get("code") == "context_length_exceeded", body
    assert f"limit of {MAX_POSITIONS - 1}" in str(body.get("message")), body
    with pytest.raises(openai.BadRequestError) as chat_error:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": long_text}],
                                       max_tokens=1, temperature=0)
    assert chat_error.value.code == "context_length_exceeded"
    assert chat_error.value.param == "messages"


def test_invalid_parameters_are_400_before_any_node_is_asked(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model_name, messages=PROMPT, top_p=3)
    assert "top_p" in str(error.value)


def test_front_door_requests_are_counted_in_the_metrics(client: openai.OpenAI, model_name: str,
                                                        mesh: tuple[Service, str]) -> None:
    greedy_chat(client, model_name)
    metrics = httpx.get(f"{mesh[0].url}/metrics").text
    assert 'meshnet_tracker_requests_total{endpoint="chat",status="200"}' in metrics
    assert 'meshnet_tracker_model_complete{model="' in metrics
