"""Fault injection (``--fault``, issue 37): a node that computes wrong on purpose, for tests and demonstrations.

Unit tests pin the setting (parsed, bounded, refused without ``MESHNET_ALLOW_FAULTS=1``) and the injector
(deterministic per session and position, about a fraction P of steps). Real processes show the fault is
visible where it must be: a 2-node mesh (``front`` 0-1, a ``back`` 2-3) answers what transformers answers
with an honest back, and something else when the back (or the front) corrupts its output or the tail answers
wrong tokens.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from meshwire import headers as h
from meshwire.frames import encode_frame
from meshwire.limits import ROUTE_TTL_S
from meshwire.receipts import (
    RECEIPT,
    ReceiptProblem,
    answer_digest,
    parse_receipt,
    sha256_hex,
    verify_receipt,
)
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from services.node.engine.faults import FaultInjector
from services.node.metrics import NodeMetrics
from services.node.settings import ALLOW_FAULTS_ENV, FaultSpec, NodeSettings
from tests.procs import (
    REPO_ROOT,
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    named_nodes,
    node_hop_key,
    service_env,
)

NUM_LAYERS = 4
HIDDEN = 64
PROMPT = [{"role": "user", "content": "Where does the river run before it reaches the sea?"}]
MAX_TOKENS = 16
LAYERS = {"front": (0, 1), "front_corrupt": (0, 1), "back": (2, 3), "back_corrupt": (2, 3), "back_wrong": (2, 3)}
FAULTS = {"front_corrupt": "corrupt-output:1.0", "back_corrupt": "corrupt-output:1.0", "back_wrong": "wrong-token:1.0"}


class _NoSessions:
    reserved_tokens = free_tokens = used_tokens = handoffs = 0

    def __len__(self) -> int:
        return 0

    def cache_bytes(self) -> int:
        return 0

    def handoff_bytes(self) -> int:
        return 0


def _injector(spec: str) -> FaultInjector:
    return FaultInjector(FaultSpec(kind=spec.split(":")[0], rate=float(spec.split(":")[1])),  # type: ignore[arg-type]
                         NodeMetrics(_NoSessions()))


# --- the setting ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kind", "rate"), [("corrupt-output:1.0", "corrupt-output", 1.0),
                                                     ("wrong-token:0.25", "wrong-token", 0.25),
                                                     (" corrupt-output : 1e-3 ", "corrupt-output", 0.001)])
def test_a_fault_spec_is_parsed_when_faults_are_allowed(monkeypatch: pytest.MonkeyPatch, text: str, kind: str,
                                                        rate: float) -> None:
    monkeypatch.setenv(ALLOW_FAULTS_ENV, "1")
    assert NodeSettings(fault=text).fault == FaultSpec(kind=kind, rate=rate)  # type: ignore[arg-type]
    assert NodeSettings().fault is None


@pytest.mark.parametrize("text", ["corrupt-output:0", "corrupt-output:1.5", "corrupt-output:-0.1", "wrong-token:nan",
                                  "bit-flip:0.5", "corrupt-output", "corrupt-output:", "wrong-token:0.5:1",
                                  "corrupt-output:" + "1" * 100])
def test_a_bad_fault_spec_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(ALLOW_FAULTS_ENV, "1")
    with pytest.raises(ValidationError, match="fault"):
        NodeSettings(fault=text)


def test_a_fault_is_refused_unless_faults_are_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_FAULTS_ENV, raising=False)
    with pytest.raises(ValidationError, match=ALLOW_FAULTS_ENV):
        NodeSettings(fault="corrupt-output:0.5")
    monkeypatch.setenv(ALLOW_FAULTS_ENV, "yes")
    with pytest.raises(ValidationError, match=ALLOW_FAULTS_ENV):
        NodeSettings(fault="corrupt-output:0.5")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_meshnet_node_refuses_a_fault_without_the_variable_in_one_line(tiny_model_dir: Path, how: str) -> None:
    env = service_env({"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_LAYERS": "0-1"})
    env.pop(ALLOW_FAULTS_ENV, None)
    args = ["--fault", "wrong-token:0.5"] if how == "flag" else []
    if how == "env":
        env["MESHNET_FAULT"] = "wrong-token:0.5"
    done = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert ALLOW_FAULTS_ENV in lines[0] and "--fault" in lines[0]


# --- the injector ---------------------------------------------------------------------------------------------


def test_corruption_is_deterministic_per_step_and_hits_about_a_fraction_p() -> None:
    injector = _injector("corrupt-output:0.3")
    hidden = torch.randn((1, 1, 8), generator=torch.Generator().manual_seed(0))
    hits = 0
    for position in range(2000):
        once = injector.hidden(position, hidden)
        again = injector.hidden(position, hidden)
        assert torch.equal(once, again)
        if once is not hidden:
            hits += 1
            assert (once - hidden).abs().max() > 0.1  # visible, far beyond rounding
    assert 450 < hits < 750  # 0.3 of 2,000 is 600 (fixed: the draw is seeded by the position)
    assert _injector("corrupt-output:1.0").hidden(0, hidden) is not hidden
    assert _injector("wrong-token:1.0").hidden(0, hidden) is hidden  # a wrong-token node computes right


def test_a_wrong_token_is_another_token_of_the_vocabulary() -> None:
    injector = _injector("wrong-token:1.0")
    for token in (0, 1, 48, 49):
        answered = injector.token(token, token, 50)
        assert answered != token and 0 <= answered < 50
        assert injector.token(token, token, 50) == answered
    assert _injector("corrupt-output:1.0").token(0, 7, 50) == 7


# --- real processes -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nodes(tiny_model_dir: Path) -> Iterator[dict[str, Service]]:
    common = {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu"}
    extra = {name: {"MESHNET_FAULT": fault, ALLOW_FAULTS_ENV: "1"} for name, fault in FAULTS.items()}
    with named_nodes(LAYERS, common, extra) as started:
        yield started


def _ask(nodes: dict[str, Service], front: str, back: str) -> str:
    hops = [RouteNode(node_id=name, endpoint=nodes[name].url, shard_start=LAYERS[name][0], shard_end=LAYERS[name][1],
                      start_layer=LAYERS[name][0], hop_key=node_hop_key(name).public_text) for name in (front, back)]
    model = httpx.get(f"{nodes[front].url}/health").json()["model"]
    route = sign_route(Route(model=model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS), TEST_ROUTE_KEY,
                       ttl_s=ROUTE_TTL_S)
    client = openai.OpenAI(base_url=f"{nodes[front].url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120,
                           default_headers={h.ROUTE: route})
    answer = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                            temperature=0)
    return answer.choices[0].message.content or ""


def _faults_injected(service: Service) -> float:
    families = text_string_to_metric_families(httpx.get(f"{service.url}/metrics").text)
    return sum(s.value for family in families for s in family.samples if s.name == "meshnet_node_faults_injected_total")


def _expected(reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> str:
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = reference.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:].tolist(), skip_special_tokens=True)


def test_an_honest_mesh_answers_what_transformers_answers(nodes: dict[str, Service], reference: PreTrainedModel,
                                                          tokenizer: PreTrainedTokenizerBase) -> None:
    assert _ask(nodes, "front", "back") == _expected(reference, tokenizer)
    assert _faults_injected(nodes["front"]) == 0 and _faults_injected(nodes["back"]) == 0


@pytest.mark.parametrize(("front", "back"), [("front", "back_corrupt"), ("front_corrupt", "back"),
                                             ("front", "back_wrong")])
def test_a_faulty_node_changes_the_answer_the_same_way_each_time(
        nodes: dict[str, Service], reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
        front: str, back: str) -> None:
    faulty = nodes[front if front in FAULTS else back]
    before = _faults_injected(faulty)
    answer = _ask(nodes, front, back)
    assert answer != _expected(reference, tokenizer)
    assert _faults_injected(faulty) > before
    assert _ask(nodes, front, back) == answer  # drawn per position: reproducible


# --- receipts from real hops (meshwire.receipts) ------------------------------------------------------------


def test_a_hop_answers_a_step_with_a_receipt_binding_its_input_and_its_output(nodes: dict[str, Service]) -> None:
    """A raw frame to the tail of ``front -> back``: its receipt verifies with ``back``'s hop key, binds the
    body sent and the token answered, and is refused when shown for another step (a replay)."""
    hops = [RouteNode(node_id=name, endpoint=nodes[name].url, shard_start=LAYERS[name][0], shard_end=LAYERS[name][1],
                      start_layer=LAYERS[name][0], hop_key=node_hop_key(name).public_text) for name in ("front", "back")]
    model = httpx.get(f"{nodes['back'].url}/health").json()["model"]
    route = sign_route(Route(model=model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS), TEST_ROUTE_KEY,
                       ttl_s=ROUTE_TTL_S)
    hidden = torch.randn((1, 3, HIDDEN), generator=torch.Generator().manual_seed(5))
    headers, body = encode_frame(hidden, session="receipt-session", extra={
        h.ROUTE: route, h.HOP_INDEX: "1", h.START_LAYER: "2", h.STEP: "0", h.POSITION_OFFSET: "0",
        h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}',
        "Authorization": f"Bearer {TEST_SECRET}"})
    response = httpx.post(f"{nodes['back'].url}/forward", headers=headers, content=body, timeout=30)
    assert response.status_code == 200, response.text
    receipt = parse_receipt(response.headers[RECEIPT])
    step = {"route_token": route, "session": "receipt-session", "node_id": "back", "hop_index": 1,
            "position_offset": 0, "positions": 3}
    key = node_hop_key("back").private.public_key()
    verify_receipt(receipt, key, **step, step=0)
    assert receipt.fields.input_sha256 == sha256_hex(body)
    assert receipt.fields.output_sha256 == answer_digest([response.json()["token"]])
    with pytest.raises(ReceiptProblem, match="replay"):
        verify_receipt(receipt, key, **step, step=1)
    with pytest.raises(ReceiptProblem, match="forged"):
        verify_receipt(receipt, node_hop_key("back_corrupt").private.public_key(), **{**step, "node_id": "back"},
                       step=0)
    httpx.post(f"{nodes['back'].url}/forward", timeout=30, content=b"", headers={
        h.WIRE: h.WIRE_VERSION, h.SESSION: "receipt-session", h.CONTROL: "close", h.ROUTE: route, h.HOP_INDEX: "1",
        h.START_LAYER: "2", "Authorization": f"Bearer {TEST_SECRET}"})
