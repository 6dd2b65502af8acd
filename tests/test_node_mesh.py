"""Nodes as real processes, chained along signed routes: the mesh generates what transformers generates.

Four node processes share the tiny model (float32) for the whole module:

* ``full``  holds layers 0-3 and serves alone;
* ``front`` holds 0-1 and heads the routes (prefill in chunks of 16 tokens);
* ``mid``   holds 2-2;
* ``back``  holds 2-3 (a KV budget of 1,024 tokens and a 5 s idle timeout).

The 2-node route is ``front -> back``; the 3-node route ``front -> mid -> back``,
where ``back`` starts at layer 3 because ``mid`` already ran layer 2. There is
no tracker: the tests sign routes with a route key the nodes pin
(``MESHNET_ROUTE_KEYS``), as the tracker signs with its own, naming each
node's hop key (``MESHNET_NODE_KEY``),
and talk to the head with the official ``openai`` client, or to ``/forward``
with raw frames where the wire itself is the point.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire import headers as h
from meshwire.auth import bearer_headers
from meshwire.frames import encode_frame
from meshwire.hop_proof import sign_request
from meshwire.limits import ROUTE_TTL_S
from meshwire.route_keys import SigningKey, b64encode
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from meshwire.row_batch import encode_rows
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    named_nodes,
    node_hop_key,
)

NUM_LAYERS = 4
HIDDEN = 64
FRONT_CHUNK_TOKENS = 16
BACK_KV_BUDGET = 1024
BACK_IDLE_TIMEOUT_S = 5.0
SETTLE_TIMEOUT_S = 20.0
SHORT_ROUTE_TTL_S = 1.0
MAX_SHORT_ROUTE_TTL_S = 64.0
"""Where the short-lived route's retries stop: a machine that cannot send one frame in a minute is broken."""
ROUTE_CLOCK_MARGIN_S = 0.5
"""Past a route's expiry, so that the node's clock (the same machine's) sees it expired too."""
LAYERS = {"full": (0, 3), "front": (0, 1), "mid": (2, 2), "back": (2, 3)}
ROUTES = {1: ("full",), 2: ("front", "back"), 3: ("front", "mid", "back")}
MESH_AUTH = bearer_headers(TEST_SECRET)
"""What the tracker sends a head: only the mesh (or a client API key) may call a node's /v1."""
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 1234}
SHORT_PROMPT = [{"role": "user", "content": "Where does the river run before it reaches the sea?"}]
LONG_PROMPT = [{"role": "user", "content": "Tell me a long story about the river."}]
EOS_PROMPT = [{"role": "user", "content": "Hello"}]
"""The tiny model answers this with an end-of-sequence token after 73 tokens (greedy)."""


# --- the mesh -----------------------------------------------------------------------------------------------


@dataclass
class Mesh:
    nodes: dict[str, Service]
    model: str
    session_routes: dict[tuple[str, tuple[str, ...]], str] = field(default_factory=dict)
    """One route token per raw-frame session: a node binds a session to the route that opened it."""

    def session_route(self, session: str, names: tuple[str, ...]) -> str:
        """The route token every frame of ``session`` along ``names`` carries (signed on first use)."""
        return self.session_routes.setdefault((session, names), self.route(*names))

    def url(self, name: str) -> str:
        return self.nodes[name].url

    def route(self, *names: str, key: SigningKey = TEST_ROUTE_KEY, ttl_s: float = ROUTE_TTL_S,
              issued_at: float | None = None) -> str:
        """A signed route token through ``names``, as the tracker would issue it."""
        hops = [RouteNode(node_id=name, endpoint=self.url(name), shard_start=LAYERS[name][0],
                          shard_end=LAYERS[name][1], start_layer=LAYERS[name][0],
                          hop_key=node_hop_key(name).public_text) for name in names]
        route = Route(model=self.model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS)
        return sign_route(route, key, ttl_s=ttl_s, now=issued_at)

    def client(self, hops: int) -> openai.OpenAI:
        """An OpenAI client talking to the head of the ``hops``-node route, with the route attached."""
        names = ROUTES[hops]
        return openai.OpenAI(base_url=f"{self.url(names[0])}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120,
                             default_headers={h.ROUTE: self.route(*names)})


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[Mesh]:
    common = {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu"}
    extra = {
        "front": {"MESHNET_PREFILL_CHUNK_TOKENS": str(FRONT_CHUNK_TOKENS)},
        "back": {"MESHNET_KV_BUDGET_TOKENS": str(BACK_KV_BUDGET), "MESHNET_IDLE_TIMEOUT_S": str(BACK_IDLE_TIMEOUT_S)},
    }
    with named_nodes(LAYERS, common, extra) as nodes:
        yield Mesh(nodes=nodes, model=httpx.get(f"{nodes['full'].url}/health").json()["model"])


@dataclass(frozen=True)
class Expected:
    text: str
    tokens: int
    prompt_tokens: int


def generate(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
             max_tokens: int, sampling: dict[str, Any] | None = None) -> Expected:
    """What single-process transformers ``generate`` answers (greedy, or seeded sampling)."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    if sampling is None:
        out = reference.generate(**inputs, do_sample=False, max_new_tokens=max_tokens)
    else:
        torch.manual_seed(sampling["seed"])
        out = reference.generate(**inputs, do_sample=True, temperature=sampling["temperature"],
                                 top_p=sampling["top_p"], top_k=sampling["top_k"], max_new_tokens=max_tokens)
    prompt_tokens = inputs["input_ids"].shape[1]
    new = out[0, prompt_tokens:].tolist()
    return Expected(tokenizer.decode(new, skip_special_tokens=True), len(new), prompt_tokens)


def sampling_args(sampling: dict[str, Any] | None) -> dict[str, Any]:
    if sampling is None:
        return {"temperature": 0}
    return {"temperature": sampling["temperature"], "top_p": sampling["top_p"], "seed": sampling["seed"],
            "extra_body": {"top_k": sampling["top_k"]}}


def stream_text(client: openai.OpenAI, model: str, messages: list[dict[str, str]], **args: Any) -> tuple[str, list[Any]]:
    chunks = list(client.chat.completions.create(model=model, messages=messages, stream=True, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# --- raw frames ---------------------------------------------------------------------------------------------


def frame(mesh: Mesh, session: str, *, step: int, offset: int, tokens: int = 1, route: tuple[str, ...] = ("front", "back"),
          hop: int = 1, reserve: int | None = None, seed: int = 7) -> tuple[dict[str, str], bytes]:
    """A valid data frame for hop ``hop`` of ``route``: random hidden states, greedy sampling."""
    hidden = torch.randn((1, tokens, HIDDEN), generator=torch.Generator().manual_seed(seed + step))
    extra = {
        h.ROUTE: mesh.session_route(session, route), h.HOP_INDEX: str(hop),
        h.START_LAYER: str(LAYERS[route[hop]][0]),
        h.STEP: str(step), h.POSITION_OFFSET: str(offset),
        h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}',
        "Authorization": f"Bearer {TEST_SECRET}",
    }
    if reserve is not None:
        extra[h.RESERVE] = str(reserve)
    return encode_frame(hidden, session=session, extra=extra)


def post_frame(url: str, headers: dict[str, str], body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/forward", headers=headers, content=body, timeout=30)


def close_session(mesh: Mesh, name: str, session: str, route: tuple[str, ...] = ("front", "back"), hop: int = 1,
                  token: str | None = None) -> None:
    response = post_frame(mesh.url(name), {
        h.WIRE: h.WIRE_VERSION, h.SESSION: session, h.CONTROL: "close",
        h.ROUTE: token or mesh.session_route(session, route),
        h.HOP_INDEX: str(hop), h.START_LAYER: str(LAYERS[route[hop]][0]), "Authorization": f"Bearer {TEST_SECRET}",
    }, b"")
    assert response.status_code == 200, response.text


def health(mesh: Mesh, name: str) -> dict[str, Any]:
    return httpx.get(f"{mesh.url(name)}/health").json()


def metric(mesh: Mesh, name: str, sample: str, **labels: str) -> float:
    """The value of one sample of ``name``'s metrics (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(f"{mesh.url(name)}/metrics").text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def settled(mesh: Mesh) -> None:
    """Wait until no node holds a session (closes after a stream's [DONE] finish asynchronously)."""
    wait_for(lambda: all(health(mesh, name)["sessions"] == 0 for name in LAYERS), "every session to close")


# --- the central invariant ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hops", [1, 2, 3])
@pytest.mark.parametrize("sampling", [None, SAMPLING], ids=["greedy", "seeded"])
def test_the_mesh_answers_exactly_what_transformers_generate_answers(
        mesh: Mesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, hops: int,
        sampling: dict[str, Any] | None) -> None:
    expected = generate(reference, tokenizer, SHORT_PROMPT, 40, sampling)
    answer = mesh.client(hops).chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, max_tokens=40,
                                                       **sampling_args(sampling))
    assert answer.choices[0].message.content == expected.text
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (expected.prompt_tokens, expected.tokens)
    assert answer.choices[0].finish_reason == "length"


CONCURRENT_STREAMS = 8
CONCURRENT_PROMPTS = [[{"role": "user", "content": f"Tell me about {topic}."}] for topic in (
    "the sea", "a cat", "the moon and the stars", "bread", "rain", "an old house on a hill", "music", "trees")]


@pytest.mark.parametrize("hops", [1, 2, 3])
@pytest.mark.parametrize("sampling", [None, SAMPLING], ids=["greedy", "seeded"])
def test_concurrent_requests_each_answer_exactly_what_they_answer_alone(
        mesh: Mesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, hops: int,
        sampling: dict[str, Any] | None) -> None:
    """Eight streams at once share batched steps on every node; each still equals transformers alone."""
    expected = [generate(reference, tokenizer, prompt, 24, sampling) for prompt in CONCURRENT_PROMPTS]
    client = mesh.client(hops)

    def ask(prompt: list[dict[str, str]]) -> str:
        answer = client.chat.completions.create(model=mesh.model, messages=prompt, max_tokens=24,
                                                **sampling_args(sampling))
        return answer.choices[0].message.content or ""

    with ThreadPoolExecutor(CONCURRENT_STREAMS) as pool:
        answers = list(pool.map(ask, CONCURRENT_PROMPTS))
    assert answers == [e.text for e in expected]


@pytest.mark.parametrize("hops", [1, 3])
def test_an_end_of_sequence_token_ends_the_answer_with_finish_reason_stop(
        mesh: Mesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, hops: int) -> None:
    expected = generate(reference, tokenizer, EOS_PROMPT, 120)
    assert expected.tokens < 120, "the tiny model should end this answer by itself"
    answer = mesh.client(hops).chat.completions.create(model=mesh.model, messages=EOS_PROMPT, max_tokens=120,
                                                       temperature=0)
    assert answer.choices[0].message.content == expected.text
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.completion_tokens == expected.tokens


@pytest.mark.parametrize("hops", [1, 2])
def test_streamed_text_equals_non_streamed_text(mesh: Mesh, hops: int) -> None:
    client = mesh.client(hops)
    whole = client.chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, max_tokens=60, **sampling_args(SAMPLING))
    text, chunks = stream_text(client, mesh.model, SHORT_PROMPT, max_tokens=60, stream_options={"include_usage": True},
                               **sampling_args(SAMPLING))
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 60
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 10, "tokens arrive one by one"


def test_a_stop_sequence_ends_the_answer_before_it_and_is_not_emitted(
        mesh: Mesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    full = generate(reference, tokenizer, SHORT_PROMPT, 40).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    client = mesh.client(2)
    answer = client.chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, max_tokens=40, temperature=0,
                                            stop=[stop])
    streamed, _ = stream_text(client, mesh.model, SHORT_PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert answer.choices[0].message.content == full[:full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    assert streamed == answer.choices[0].message.content


def test_a_raw_completion_skips_the_chat_template(mesh: Mesh, reference: PreTrainedModel,
                                                  tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = "The river runs past the old mill"
    inputs = tokenizer(prompt, return_tensors="pt")
    out = reference.generate(**inputs, do_sample=False, max_new_tokens=20)
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    answer = mesh.client(2).completions.create(model=mesh.model, prompt=prompt, max_tokens=20, temperature=0)
    assert answer.choices[0].text == expected


def test_a_long_generation_moves_exactly_one_position_per_decode_frame(
        mesh: Mesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    settled(mesh)
    new_tokens = 220
    before = {name: (metric(mesh, name, "meshnet_node_frame_tokens_count"),
                     metric(mesh, name, "meshnet_node_frame_tokens_bucket", le="1.0"),
                     metric(mesh, name, "meshnet_node_frame_tokens_sum")) for name in ("mid", "back")}
    expected = generate(reference, tokenizer, LONG_PROMPT, new_tokens)
    assert expected.tokens == new_tokens, "the tiny model should not end this answer early"
    text, _ = stream_text(mesh.client(3), mesh.model, LONG_PROMPT, max_tokens=new_tokens, temperature=0)
    assert text == expected.text

    prompt = expected.prompt_tokens
    chunks = [min(FRONT_CHUNK_TOKENS, prompt - i) for i in range(0, prompt, FRONT_CHUNK_TOKENS)]
    decode_frames = new_tokens - 1
    for name in ("mid", "back"):
        count, ones, total = (metric(mesh, name, "meshnet_node_frame_tokens_count"),
                              metric(mesh, name, "meshnet_node_frame_tokens_bucket", le="1.0"),
                              metric(mesh, name, "meshnet_node_frame_tokens_sum"))
        assert count - before[name][0] == len(chunks) + decode_frames, name
        assert ones - before[name][1] == chunks.count(1) + decode_frames, name
        assert total - before[name][2] == prompt + decode_frames, name


# --- sessions and the KV budget -----------------------------------------------------------------------------


def test_a_finished_answer_leaves_no_session_and_no_kv_cache_on_any_node(mesh: Mesh) -> None:
    mesh.client(3).chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, max_tokens=5, temperature=0)
    settled(mesh)
    for name in LAYERS:
        assert metric(mesh, name, "meshnet_node_kv_bytes") == 0
        assert health(mesh, name)["kv_used_tokens"] == 0


def test_a_client_that_goes_away_mid_stream_stops_the_generation_and_leaves_no_session_behind(mesh: Mesh) -> None:
    settled(mesh)
    max_tokens = BACK_KV_BUDGET - 100
    generated = metric(mesh, "front", "meshnet_node_tokens_generated_total")
    body = {"model": mesh.model, "messages": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{mesh.url('front')}/v1/chat/completions", json=body, timeout=60,
                      headers={h.ROUTE: mesh.route("front", "mid", "back"), **MESH_AUTH}) as response:
        lines = response.iter_lines()
        assert sum(next(lines).startswith("data:") for _ in range(8)) >= 3
    settled(mesh)
    assert metric(mesh, "front", "meshnet_node_tokens_generated_total") - generated < max_tokens


def test_closing_a_session_frees_its_cache_here_and_on_the_next_hops(mesh: Mesh) -> None:
    route = ("front", "mid", "back")
    post = post_frame(mesh.url("mid"), *frame(mesh, "s-close", step=0, offset=0, tokens=6, route=route, reserve=50))
    assert post.status_code == 200, post.text
    assert health(mesh, "mid")["kv_used_tokens"] == 6 and health(mesh, "back")["kv_used_tokens"] == 6
    assert metric(mesh, "back", "meshnet_node_kv_bytes") > 0
    close_session(mesh, "mid", "s-close", route=route)
    for name in ("mid", "back"):
        assert health(mesh, name)["sessions"] == 0
        assert metric(mesh, name, "meshnet_node_kv_bytes") == 0


def test_an_idle_session_expires_and_its_cache_is_freed(mesh: Mesh) -> None:
    expired = metric(mesh, "back", "meshnet_node_sessions_expired_total")
    assert post_frame(mesh.url("back"), *frame(mesh, "s-idle", step=0, offset=0, tokens=4)).status_code == 200
    assert health(mesh, "back")["sessions"] == 1
    wait_for(lambda: health(mesh, "back")["sessions"] == 0, "the idle session to expire",
             timeout_s=BACK_IDLE_TIMEOUT_S * 4)
    assert metric(mesh, "back", "meshnet_node_sessions_expired_total") == expired + 1
    assert health(mesh, "back")["kv_free_tokens"] == BACK_KV_BUDGET
    late = post_frame(mesh.url("back"), *frame(mesh, "s-idle", step=1, offset=4))
    assert late.status_code == 409 and late.json()["error"]["code"] == "unknown_session"


def test_a_session_the_kv_budget_cannot_hold_is_refused_with_503_and_admitted_once_room_is_freed(mesh: Mesh) -> None:
    settled(mesh)
    hog = post_frame(mesh.url("back"), *frame(mesh, "s-hog", step=0, offset=0, reserve=BACK_KV_BUDGET - 60))
    assert hog.status_code == 200, hog.text
    body = {"model": mesh.model, "messages": EOS_PROMPT, "max_tokens": 40, "temperature": 0}
    refused = httpx.post(f"{mesh.url('front')}/v1/chat/completions", json=body,
                         headers={h.ROUTE: mesh.route("front", "back"), **MESH_AUTH}, timeout=60)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "kv_budget"
    assert int(refused.headers["retry-after"]) > 0
    assert health(mesh, "back")["sessions"] == 1, "the refused session holds nothing"
    close_session(mesh, "back", "s-hog")
    admitted = httpx.post(f"{mesh.url('front')}/v1/chat/completions", json=body,
                          headers={h.ROUTE: mesh.route("front", "back"), **MESH_AUTH}, timeout=60)
    assert admitted.status_code == 200, admitted.text


# --- bad frames -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadFrame:
    name: str
    status: int
    code: str | None
    mutate: Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]]


def _with(**changes: str | None) -> Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]]:
    def mutate(headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        out = {k: v for k, v in headers.items() if k not in changes or changes[k] is not None}
        out.update({k: v for k, v in changes.items() if v is not None})
        return out, body
    return mutate


def hmac_route(mesh: Mesh, *names: str) -> str:
    """A route in the format routes had before Ed25519: HMAC-SHA256 with the shared secret, which every node held."""
    hops = [RouteNode(node_id=name, endpoint=mesh.url(name), shard_start=LAYERS[name][0], shard_end=LAYERS[name][1],
                      start_layer=LAYERS[name][0], hop_key=node_hop_key(name).public_text) for name in names]
    payload = {"route": Route(model=mesh.model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS)
               .model_dump(mode="json"), "exp": time.time() + 60, "iat": time.time(), "v": 1}
    first = b64encode(orjson.dumps(payload))
    return f"{first}.{b64encode(hmac.new(TEST_SECRET.encode(), first.encode(), hashlib.sha256).digest())}"


def _signed_by(signer: str, key: SigningKey) -> Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]]:
    """The frame signed by ``signer`` with ``key`` (the hop proof of meshwire.hop_proof) instead of the secret."""
    def mutate(headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        out = {k: v for k, v in headers.items() if k != "Authorization"}
        return {**out, **sign_request(key, signer, "/forward", out, body)}, body
    return mutate


def bad_frames(mesh: Mesh) -> list[BadFrame]:
    wrong_hop_route = mesh.route("front", "mid", "back")
    forged = mesh.route("front", "back", key=SigningKey.generate())
    return [
        BadFrame("no credential, garbage frame", 401, "unauthorized",
                 lambda hd, b: ({h.SHAPE: "nonsense"}, b"x")),
        BadFrame("wrong credential", 403, "forbidden", _with(Authorization="Bearer wrong-secret")),
        BadFrame("route signed with a key the tracker never published", 403, "bad_route", _with(**{h.ROUTE: forged})),
        BadFrame("route signed with the shared secret (HMAC)", 403, "bad_route",
                 _with(**{h.ROUTE: hmac_route(mesh, "front", "back")})),
        BadFrame("frame signed by a node that is not the route's previous hop", 403, "bad_proof",
                 _signed_by("mid", node_hop_key("mid"))),
        BadFrame("frame signed in the previous hop's name with another key", 403, "bad_proof",
                 _signed_by("front", SigningKey.generate())),
        BadFrame("route naming another node at this hop", 403, "bad_route", _with(**{h.ROUTE: wrong_hop_route})),
        BadFrame("no route", 403, "bad_route", _with(**{h.ROUTE: None})),
        BadFrame("body shorter than the shape", 400, "bad_length", lambda hd, b: (hd, b[:-4])),
        BadFrame("unknown dtype", 400, "unknown_dtype", _with(**{h.DTYPE: "int8"})),
        BadFrame("hidden size of another model", 400, "bad_shape", _with(**{h.SHAPE: "1,2,32"})),
        BadFrame("malformed shape", 400, "bad_shape", _with(**{h.SHAPE: "1,x,64"})),
        BadFrame("frame over the size limit", 400, "too_large", _with(**{h.SHAPE: "1,400000,64"})),
        BadFrame("chunk index past the total", 400, "bad_chunk", _with(**{h.CHUNK_INDEX: "3", h.CHUNK_TOTAL: "2"})),
        BadFrame("unknown encoding", 400, "bad_encoding", _with(**{h.ENCODING: "brotli"})),
        BadFrame("zlib body that does not inflate", 400, "bad_encoding", _with(**{h.ENCODING: "zlib"})),
        BadFrame("another wire version", 400, "wire_version", _with(**{h.WIRE: "1"})),
        BadFrame("missing step", 400, "bad_header", _with(**{h.STEP: None})),
        BadFrame("start layer the route does not give", 400, "bad_header", _with(**{h.START_LAYER: "3"})),
        BadFrame("bad sampling JSON", 400, "bad_header", _with(**{h.SAMPLING: "{not json"})),
        BadFrame("step out of order", 409, "bad_step", _with(**{h.STEP: "999"})),
        BadFrame("position that does not follow the cache", 409, "bad_position", _with(**{h.POSITION_OFFSET: "999"})),
        BadFrame("step of a session never opened", 409, "unknown_session", _with(**{h.SESSION: "s-nobody"})),
    ]


def test_every_bad_frame_class_is_refused_while_sessions_on_the_node_go_on(
        mesh: Mesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    settled(mesh)
    expected = generate(reference, tokenizer, LONG_PROMPT, 200)
    started = threading.Event()

    def chat() -> str:
        stream = mesh.client(2).chat.completions.create(model=mesh.model, messages=LONG_PROMPT, max_tokens=200,
                                                        temperature=0, stream=True)
        pieces = []
        for chunk in stream:
            started.set()
            pieces.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        return "".join(pieces)

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(chat)
        assert started.wait(60), "the concurrent chat never started"
        opened = post_frame(mesh.url("back"), *frame(mesh, "s-target", step=0, offset=0, tokens=3, reserve=64))
        assert opened.status_code == 200, opened.text
        wrong: list[str] = []
        step = 1
        for bad in bad_frames(mesh):
            response = post_frame(mesh.url("back"), *bad.mutate(*frame(mesh, "s-target", step=step, offset=step + 2)))
            code = response.json().get("error", {}).get("code") if response.content else None
            if (response.status_code, code) != (bad.status, bad.code):
                wrong.append(f"{bad.name}: got {response.status_code} {code}, want {bad.status} {bad.code}")
            # the session goes on after every refusal (which also keeps it within back's short idle timeout)
            following = post_frame(mesh.url("back"), *frame(mesh, "s-target", step=step, offset=step + 2))
            if following.status_code != 200:
                wrong.append(f"after {bad.name}: the next valid step got {following.status_code} {following.text}")
            step += 1
        close_session(mesh, "back", "s-target")
        assert answer.result(timeout=120) == expected.text
    assert not wrong, "\n".join(wrong)
    assert following.status_code == 200 and isinstance(following.json()["token"], int), following.text
    assert health(mesh, "back")["status"] == "ok"


# --- who may do what -----------------------------------------------------------------------------------------


def test_the_head_refuses_a_route_whose_signature_does_not_verify(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{mesh.url('front')}/v1", api_key=TEST_SECRET, max_retries=0,
                           default_headers={h.ROUTE: mesh.route("front", "back", key=SigningKey.generate())})
    with pytest.raises(openai.PermissionDeniedError, match="not one of the tracker's keys"):
        client.chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, max_tokens=3)


def test_a_node_refuses_to_head_a_route_that_does_not_start_with_it(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{mesh.url('full')}/v1", api_key=TEST_SECRET, max_retries=0,
                           default_headers={h.ROUTE: mesh.route("front", "back")})
    with pytest.raises(openai.PermissionDeniedError, match="names front"):
        client.chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, max_tokens=3)


def test_a_node_without_layer_0_is_not_a_head(mesh: Mesh) -> None:
    response = httpx.post(f"{mesh.url('back')}/v1/chat/completions", headers=MESH_AUTH,
                          json={"model": mesh.model, "messages": SHORT_PROMPT}, timeout=30)
    assert response.status_code == 409 and response.json()["error"]["code"] == "not_head"


def test_a_partial_head_without_a_route_or_a_tracker_says_it_has_no_route(mesh: Mesh) -> None:
    response = httpx.post(f"{mesh.url('front')}/v1/chat/completions", headers=MESH_AUTH,
                          json={"model": mesh.model, "messages": SHORT_PROMPT}, timeout=30)
    assert response.status_code == 503 and response.json()["error"]["code"] == "no_route"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_heads_api_refuses_callers_without_the_mesh_credential(mesh: Mesh, path: str) -> None:
    body = {"model": mesh.model, "messages": SHORT_PROMPT, "prompt": "a", "max_tokens": 2}
    for name in ("full", "front"):
        missing = httpx.post(f"{mesh.url(name)}{path}", json=body, timeout=30,
                             headers={h.ROUTE: mesh.route("front", "back")})
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        wrong = httpx.post(f"{mesh.url(name)}{path}", json=body, timeout=30, headers=bearer_headers("sk-guess"))
        assert wrong.status_code == 403 and wrong.json()["error"]["type"] == "permission_error"


def test_a_temperature_too_small_to_sample_with_is_a_400_not_a_node_failure(mesh: Mesh) -> None:
    client = mesh.client(2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, max_tokens=3, temperature=1e-45)
    headers, body = frame(mesh, "s-tiny-temperature", step=0, offset=0)
    headers[h.SAMPLING] = '{"temperature": 1e-45, "top_p": 1.0, "top_k": 0, "seed": 0}'
    answer = post_frame(mesh.url("back"), headers, body)
    assert answer.status_code == 400 and "temperature" in answer.json()["error"]["message"]


def test_a_bad_request_is_400_naming_the_field(mesh: Mesh) -> None:
    client = mesh.client(1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, temperature=7)


def test_an_unknown_model_is_404(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{mesh.url('full')}/v1", api_key=TEST_SECRET, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.chat.completions.create(model="some-other-model", messages=SHORT_PROMPT)


def test_a_node_holding_every_layer_serves_alone_without_a_route(
        mesh: Mesh, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    client = openai.OpenAI(base_url=f"{mesh.url('full')}/v1", api_key=TEST_SECRET, max_retries=0)
    answer = client.chat.completions.create(model=mesh.model, messages=SHORT_PROMPT, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == generate(reference, tokenizer, SHORT_PROMPT, 12).text


def test_health_reports_the_layers_and_the_kv_budget(mesh: Mesh) -> None:
    back = health(mesh, "back")
    assert (back["shard_start"], back["shard_end"], back["tail"], back["head"]) == (2, 3, True, False)
    assert back["kv_budget_tokens"] == BACK_KV_BUDGET
    assert back["decode_tokens_per_s"] > 0


def test_a_route_that_expires_mid_session_keeps_serving_it_but_opens_no_new_session(mesh: Mesh) -> None:
    """Waits for the route's expiry rather than racing it: the session opens while the route is valid (a
    longer-lived route is signed if a loaded machine took too long), then the test waits until it has expired."""
    ttl_s = SHORT_ROUTE_TTL_S
    while True:
        issued_at = time.time()
        short_lived = mesh.route("front", "back", ttl_s=ttl_s, issued_at=issued_at)
        headers, body = frame(mesh, "outlives-its-route", step=0, offset=0, tokens=3, reserve=16)
        opened = post_frame(mesh.url("back"), {**headers, h.ROUTE: short_lived}, body)
        if opened.status_code == 200:
            break
        assert opened.status_code == 403 and "expired" in opened.json()["error"]["message"], opened.text
        assert ttl_s < MAX_SHORT_ROUTE_TTL_S, "a route expired before its first frame however long it lived"
        ttl_s *= 4
    while time.time() <= issued_at + ttl_s + ROUTE_CLOCK_MARGIN_S:
        time.sleep(0.1)
    headers, body = frame(mesh, "outlives-its-route", step=1, offset=3)
    assert post_frame(mesh.url("back"), {**headers, h.ROUTE: short_lived}, body).status_code == 200
    headers, body = frame(mesh, "opened-too-late", step=0, offset=0, tokens=3, reserve=16)
    refused = post_frame(mesh.url("back"), {**headers, h.ROUTE: short_lived}, body)
    assert refused.status_code == 403
    assert "expired" in refused.json()["error"]["message"]
    close_session(mesh, "back", "outlives-its-route", token=short_lived)


def test_a_batch_of_frames_is_answered_row_by_row_and_one_bad_row_fails_alone(mesh: Mesh) -> None:
    opened = [frame(mesh, f"s-rows-{i}", step=0, offset=0, tokens=3, reserve=16) for i in range(3)]
    assert all(post_frame(mesh.url("back"), *f).status_code == 200 for f in opened)
    rows = [frame(mesh, f"s-rows-{i}", step=1, offset=3) for i in range(3)]
    rows[1] = ({**rows[1][0], h.STEP: "7"}, rows[1][1])  # out of order: this row alone is refused
    answer = httpx.post(f"{mesh.url('back')}/forward/rows", content=encode_rows(rows), timeout=30,
                        headers={**MESH_AUTH, "Content-Type": "application/x-meshnet-rows"})
    assert answer.status_code == 200, answer.text
    statuses = [row["status"] for row in answer.json()["rows"]]
    assert statuses == [200, 409, 200]
    assert all(isinstance(answer.json()["rows"][i]["body"]["token"], int) for i in (0, 2))
    for i in range(3):
        close_session(mesh, "back", f"s-rows-{i}")


def test_a_batch_of_frames_needs_the_mesh_credential_and_a_well_formed_body(mesh: Mesh) -> None:
    body = encode_rows([frame(mesh, "s-rows-anon", step=0, offset=0)])
    anonymous = httpx.post(f"{mesh.url('back')}/forward/rows", content=body, timeout=30)
    assert anonymous.status_code == 401
    garbled = httpx.post(f"{mesh.url('back')}/forward/rows", content=b"\x00\x00\x00\x09not json!", timeout=30,
                         headers=MESH_AUTH)
    assert garbled.status_code == 400 and garbled.json()["error"]["code"] == "bad_header"
    assert "s-rows-anon" not in str(health(mesh, "back"))


def test_a_session_answers_only_the_route_that_opened_it(mesh: Mesh) -> None:
    headers, body = frame(mesh, "s-bound", step=0, offset=0, tokens=3, reserve=16)
    assert post_frame(mesh.url("back"), headers, body).status_code == 200
    expired_elsewhere = mesh.route("front", "back", ttl_s=1.0, issued_at=time.time() - 60)  # validly signed, another request's, expired
    fresh_elsewhere = mesh.route("front", "back")
    for other in (expired_elsewhere, fresh_elsewhere):
        headers, body = frame(mesh, "s-bound", step=1, offset=3)
        stepped = post_frame(mesh.url("back"), {**headers, h.ROUTE: other}, body)
        assert stepped.status_code == 403 and stepped.json()["error"]["code"] == "bad_route", stepped.text
        closed = post_frame(mesh.url("back"), {
            h.WIRE: h.WIRE_VERSION, h.SESSION: "s-bound", h.CONTROL: "close", h.ROUTE: other, h.HOP_INDEX: "1",
            h.START_LAYER: str(LAYERS["back"][0]), **MESH_AUTH}, b"")
        assert closed.status_code == 403 and closed.json()["error"]["code"] == "bad_route", closed.text
    headers, body = frame(mesh, "s-bound", step=1, offset=3)
    assert post_frame(mesh.url("back"), headers, body).status_code == 200  # untouched: its own route goes on
    close_session(mesh, "back", "s-bound")
