"""Speculative steps along the route: drafted tokens travel with the last one, the tail verifies them.

Four node processes share the tiny model (float32): two heads of layers 0-1,
``spec`` (``MESHNET_SPECULATE=on``: it drafts whenever prompt lookup has a
proposal) and ``plain`` (``off``), then ``mid`` (2-2) and ``back`` (2-3). The
2-node routes are ``<head> -> back``, the 3-node ones ``<head> -> mid -> back``.

What must hold: greedy output with speculation equals output without, token
for token, and equals transformers, while drafts are made (the tiny model's
random weights never repeat themselves, so prompt lookup's drafts are all
rejected here; ``test_speculation_default_model`` has accepted ones); the tail
answers the verified run and every hop drops the KV rows of rejected
positions (raw frames with a draft the tail must accept in part); seeded sampling with speculation keeps the distribution of tokens
(per position, over many seeds, within a stated tolerance); a speculative
frame that does not add up is refused.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire import errors
from meshwire import headers as h
from meshwire.frames import encode_frame
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    named_nodes,
    node_hop_key,
)

NUM_LAYERS = 4
HIDDEN = 64
LAYERS = {"spec": (0, 1), "plain": (0, 1), "mid": (2, 2), "back": (2, 3)}
COPY_PROMPT = [{"role": "user", "content": "Repeat this line twice: the river runs past the old mill and under "
                                           "the stone bridge. the river runs past the old mill and under the"}]
OTHER_PROMPT = [{"role": "user", "content": "Where does the river run before it reaches the sea?"}]
SAMPLING_SEEDS = 160
SAMPLED_TOKENS = 4
SAMPLING = {"temperature": 0.5, "top_k": 5}
"""At most 5 candidates a position, so 160 draws estimate each position's distribution well."""
TV_TOLERANCE = 0.25
"""Largest total-variation distance allowed between the per-position token frequencies of the two heads.

Two samples of 160 draws of one distribution over 5 tokens differ by about
0.08 in TV on average (sampling noise; 0.25 is beyond three times that); a
speculative sampler that kept drafted tokens too often moves whole positions
far beyond it (the tiny model's drafts lie outside its top 5, so always
accepting them gives a TV near 1 against ``plain``)."""
PARALLEL_REQUESTS = 4


@pytest.fixture(scope="module")
def nodes(tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    common = {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu"}
    extra = {"spec": {"MESHNET_SPECULATE": "on", "MESHNET_SPECULATE_MAX": "4"}, "plain": {"MESHNET_SPECULATE": "off"}}
    with named_nodes(LAYERS, common, extra) as started:
        yield started


@pytest.fixture(scope="module")
def model_name(nodes: dict[str, Service]) -> str:
    return str(httpx.get(f"{nodes['spec'].url}/health").json()["model"])


def route(nodes: dict[str, Service], model: str, *names: str) -> str:
    hops = [RouteNode(node_id=name, endpoint=nodes[name].url, shard_start=LAYERS[name][0], shard_end=LAYERS[name][1],
                      start_layer=LAYERS[name][0], hop_key=node_hop_key(name).public_text) for name in names]
    return sign_route(Route(model=model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS), TEST_ROUTE_KEY)


def client(nodes: dict[str, Service], model: str, head: str, hops: int) -> openai.OpenAI:
    names = (head, "back") if hops == 2 else (head, "mid", "back")
    return openai.OpenAI(base_url=f"{nodes[head].url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120,
                         default_headers={h.ROUTE: route(nodes, model, *names)})


def metric(service: Service, sample: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{service.url}/metrics").text):
        for found in family.samples:
            if found.name == sample:
                return float(found.value)
    return 0.0


def reference_text(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                   max_tokens: int) -> str:
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = reference.generate(**inputs, do_sample=False, max_new_tokens=max_tokens)
    return str(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:].tolist(), skip_special_tokens=True))


@pytest.mark.parametrize("hops", [2, 3])
def test_greedy_output_with_speculation_equals_output_without_and_transformers(
        nodes: dict[str, Service], model_name: str, reference: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase, hops: int) -> None:
    drafted_before = metric(nodes["spec"], "meshnet_node_drafted_tokens_total")
    accepted_before = metric(nodes["spec"], "meshnet_node_accepted_tokens_total")
    for messages in (COPY_PROMPT, OTHER_PROMPT):
        expected = reference_text(reference, tokenizer, messages, 48)
        answers = {}
        for head in ("spec", "plain"):
            answer = client(nodes, model_name, head, hops).chat.completions.create(
                model=model_name, messages=messages, max_tokens=48, temperature=0)
            answers[head] = answer.choices[0].message.content
        assert answers["spec"] == answers["plain"] == expected
    drafted = metric(nodes["spec"], "meshnet_node_drafted_tokens_total") - drafted_before
    accepted = metric(nodes["spec"], "meshnet_node_accepted_tokens_total") - accepted_before
    assert drafted > 0
    assert 0 < accepted <= drafted  # the copy prompt's answer repeats it: greedy drafts from it are taken
    assert metric(nodes["plain"], "meshnet_node_drafted_tokens_total") == 0


def test_a_speculative_stream_sends_one_chunk_per_token(nodes: dict[str, Service], model_name: str,
                                                        reference: PreTrainedModel,
                                                        tokenizer: PreTrainedTokenizerBase) -> None:
    chunks = list(client(nodes, model_name, "spec", 2).chat.completions.create(
        model=model_name, messages=COPY_PROMPT, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage)
    assert text == reference_text(reference, tokenizer, COPY_PROMPT, 40)
    assert usage.completion_tokens == 40
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 0.5 * usage.completion_tokens  # token by token (a character may span two)


# --- raw frames: the tail verifies, every hop drops rejected rows --------------------------------------------


SPEC_ROUTE = ("spec", "mid", "back")


def _frame(nodes: dict[str, Service], model: str, session: str, *, step: int, offset: int, hidden: torch.Tensor,
           draft: tuple[int, ...] | None = None, wire: str | None = None) -> tuple[dict[str, str], bytes]:
    """A frame for hop 1 (``mid``) of ``spec -> mid -> back``."""
    extra = {
        h.ROUTE: _ROUTES.setdefault(session, route(nodes, model, *SPEC_ROUTE)), h.HOP_INDEX: "1",
        h.START_LAYER: "2", h.STEP: str(step), h.POSITION_OFFSET: str(offset),
        h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}',
        "Authorization": f"Bearer {TEST_SECRET}",
    }
    if step == 0:
        extra[h.RESERVE] = "64"
    if draft is not None:
        extra[h.DRAFT] = ",".join(map(str, draft))
    return encode_frame(hidden, session=session, extra=extra,
                        wire_version=wire or (h.SPECULATIVE_WIRE_VERSION if draft else h.WIRE_VERSION))


_ROUTES: dict[str, str] = {}


def _post(nodes: dict[str, Service], frame: tuple[dict[str, str], bytes]) -> httpx.Response:
    return httpx.post(f"{nodes['mid'].url}/forward", headers=frame[0], content=frame[1], timeout=30)


def _random(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn((1, tokens, HIDDEN), generator=torch.Generator().manual_seed(seed))


def test_the_tail_answers_the_verified_run_and_every_hop_keeps_only_its_positions(
        nodes: dict[str, Service], model_name: str) -> None:
    prompt, step = _random(5, 0), _random(5, 1)
    # What the tail picks after each position of the step, one position at a time (a plain session).
    picks = []
    for index in range(5):
        frame = _frame(nodes, model_name, f"s-plain-{index}", step=0, offset=0,
                       hidden=torch.cat([prompt, step[:, :index + 1]], dim=1))
        answer = _post(nodes, frame)
        assert answer.status_code == 200, answer.text
        picks.append(answer.json()["token"])
    # Draft the first two picks right and the third wrong: the run is those two and the tail's third pick.
    draft = (picks[0], picks[1], (picks[2] + 1) % 600, picks[3])
    session = "s-spec-kv"
    assert _post(nodes, _frame(nodes, model_name, session, step=0, offset=0, hidden=prompt)).status_code == 200
    used = {name: metric(nodes[name], "meshnet_node_kv_tokens_used") for name in ("mid", "back")}
    answer = _post(nodes, _frame(nodes, model_name, session, step=1, offset=5, hidden=step, draft=draft))
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokens"] == picks[:3] and answer.json()["token"] == picks[0]
    # The rows of the rejected drafts are gone on both hops: each holds the prompt and the run's 3 positions.
    for name in ("mid", "back"):
        assert metric(nodes[name], "meshnet_node_kv_tokens_used") - used[name] == 3, name
    stale = _post(nodes, _frame(nodes, model_name, session, step=2, offset=10, hidden=_random(1, 2)))
    assert stale.status_code == 409  # an offset past the kept rows does not follow them
    follow = _post(nodes, _frame(nodes, model_name, session, step=2, offset=8, hidden=_random(1, 2)))
    assert follow.status_code == 200, follow.text


@pytest.mark.parametrize(("tokens", "draft", "wire", "code"), [
    (3, "1", None, "bad_header"),                     # 3 positions verify 2 drafts, not 1
    (2, "1", h.WIRE_VERSION, "wire_version"),         # a speculative frame must say so in its version
    (2, "-1", None, "bad_header"),                    # not a token id
])
def test_a_speculative_frame_that_does_not_add_up_is_refused(nodes: dict[str, Service], model_name: str,
                                                              tokens: int, draft: str, wire: str | None,
                                                              code: str) -> None:
    session = f"s-spec-bad-{tokens}-{code}-{draft}"
    assert _post(nodes, _frame(nodes, model_name, session, step=0, offset=0, hidden=_random(3, 0))).status_code == 200
    headers, body = _frame(nodes, model_name, session, step=1, offset=3, hidden=_random(tokens, 1),
                           wire=wire or h.SPECULATIVE_WIRE_VERSION)
    headers[h.DRAFT] = draft
    refused = _post(nodes, (headers, body))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == code, refused.text


# --- seeded sampling keeps its distribution ------------------------------------------------------------------


def _sampled(nodes: dict[str, Service], model: str, head: str, seed: int) -> list[int]:
    answer = client(nodes, model, head, 2).chat.completions.create(
        model=model, messages=COPY_PROMPT, max_tokens=SAMPLED_TOKENS, temperature=SAMPLING["temperature"], seed=seed,
        logprobs=True, extra_body={"top_k": SAMPLING["top_k"]})
    content = answer.choices[0].logprobs.content or []
    return [hash(entry.token) for entry in content]


def _total_variation(a: list[Any], b: list[Any]) -> float:
    ca, cb = Counter(a), Counter(b)
    return 0.5 * sum(abs(ca[key] / len(a) - cb[key] / len(b)) for key in set(ca) | set(cb))


@pytest.mark.timeout(900)
def test_seeded_sampling_with_speculation_keeps_the_distribution_of_every_position(
        nodes: dict[str, Service], model_name: str) -> None:
    drafted_before = metric(nodes["spec"], "meshnet_node_drafted_tokens_total")
    with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
        runs = {head: list(pool.map(lambda seed, head=head: _sampled(nodes, model_name, head, seed),
                                    range(SAMPLING_SEEDS)))
                for head in ("spec", "plain")}
    assert metric(nodes["spec"], "meshnet_node_drafted_tokens_total") > drafted_before  # speculation ran
    for position in range(1, SAMPLED_TOKENS):
        spec = [run[position] for run in runs["spec"] if len(run) > position]
        plain = [run[position] for run in runs["plain"] if len(run) > position]
        assert len(spec) > SAMPLING_SEEDS // 2 and len(plain) > SAMPLING_SEEDS // 2
        assert _total_variation(spec, plain) <= TV_TOLERANCE, position


# --- a hop older than speculation ----------------------------------------------------------------------------


class _OlderHop:
    """A proxy in front of ``back`` that answers as a node predating speculation: a frame of wire version 3
    is refused (400 ``wire_version``, as that node's frame check refuses any version it does not know), every
    other request is passed on unchanged (hop proofs included)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.refused = 0
        self.passed = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get(h.WIRE, "").strip() == h.SPECULATIVE_WIRE_VERSION:
                    proxy.refused += 1
                    payload = errors.error_body(f"{h.WIRE} must be one of ['2']", errors.INVALID_REQUEST,
                                                "wire_version", node_id="back")
                    self._answer(400, orjson.dumps(payload), "application/json")
                    return
                proxy.passed += 1
                answer = httpx.post(f"{proxy.target}{self.path}", headers=dict(self.headers.items()), content=body,
                                    timeout=60)
                self._answer(answer.status_code, answer.content, answer.headers.get("content-type", ""))

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("hops", [2, 3])
def test_a_hop_that_refuses_speculative_frames_gets_plain_ones_and_the_answer_goes_on(
        nodes: dict[str, Service], model_name: str, reference: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase, hops: int) -> None:
    older = _OlderHop(nodes["back"].url)
    try:
        names = ("spec", "back") if hops == 2 else ("spec", "mid", "back")
        endpoints = {**{name: nodes[name].url for name in names}, "back": older.url}
        route_nodes = [RouteNode(node_id=name, endpoint=endpoints[name], shard_start=LAYERS[name][0],
                                 shard_end=LAYERS[name][1], start_layer=LAYERS[name][0],
                                 hop_key=node_hop_key(name).public_text) for name in names]
        token = sign_route(Route(model=model_name, nodes=plan_start_layers(route_nodes), num_layers=NUM_LAYERS),
                           TEST_ROUTE_KEY)
        spec = openai.OpenAI(base_url=f"{nodes['spec'].url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120,
                             default_headers={h.ROUTE: token})
        drafted_before = metric(nodes["spec"], "meshnet_node_drafted_tokens_total")
        answer = spec.chat.completions.create(model=model_name, messages=COPY_PROMPT, max_tokens=32, temperature=0)
        assert answer.choices[0].message.content == reference_text(reference, tokenizer, COPY_PROMPT, 32)
        assert older.refused >= 1  # a speculative frame reached it and was refused
        # The head stopped drafting once the route said it cannot verify: one speculative step, no more.
        assert metric(nodes["spec"], "meshnet_node_drafted_tokens_total") - drafted_before <= 4
    finally:
        older.close()
