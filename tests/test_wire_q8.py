"""8-bit blockwise activations (``--wire-dtype int8``): the codec, the frame encoding, the fallback to exact frames.

The codec's error is bounded by half a block's scale; a frame announces the
dtype it decodes to; a wrong length or an unknown encoding is refused before
anything is computed; a head whose next hop does not know ``q8`` sends it
exact frames instead of failing the route.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from meshwire import headers as h
from meshwire import q8
from meshwire.forward_step import ForwardAnswer
from meshwire.frames import FrameError, decode_frame, encode_frame, parse_frame_headers
from meshwire.routes import RouteNode
from services.node.hop.hop_client import ChainFailure, hop_failed, judge_payload
from services.node.hop.route_step import Onward, RouteStepper
from services.node.settings import NodeSettings
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    node_hop_key,
    pinned_node_env,
    start_service,
    wait_healthy,
)


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 7, 576), (1, 3, 50), (2, 5)])
def test_quantised_values_are_within_half_a_step_of_the_original(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    tensor = torch.randn(shape) * 3
    tensor.view(-1)[0] = 400.0  # an outlier only spoils its own block
    body = q8.quantize(tensor)
    assert len(body) == q8.q8_nbytes(tensor.numel())
    back = q8.dequantize(body, shape, torch.float32)
    flat, got = tensor.reshape(-1), back.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, q8.blocks(flat.numel()) * q8.BLOCK - flat.numel()))
    step = padded.reshape(-1, q8.BLOCK).abs().amax(dim=1) / q8.LEVELS
    bound = step.repeat_interleave(q8.BLOCK)[:flat.numel()] / 2 + 1e-6
    assert bool(((got - flat).abs() <= bound).all())


def test_an_all_zero_block_stays_zero_and_a_body_of_the_wrong_length_is_refused() -> None:
    body = q8.quantize(torch.zeros(1, 2, 40))
    assert bool((q8.dequantize(body, (1, 2, 40), torch.float32) == 0).all())
    with pytest.raises(ValueError):
        q8.dequantize(body[:-1], (1, 2, 40), torch.float32)


def test_a_q8_frame_is_about_a_quarter_of_float32_and_decodes_to_its_announced_dtype() -> None:
    tensor = torch.randn(1, 3, 576)
    headers, body = encode_frame(tensor, session="s-1", encoding="q8")
    _exact_headers, exact = encode_frame(tensor, session="s-1")
    assert headers[h.ENCODING] == "q8" and headers[h.DTYPE] == "float32"
    assert len(body) == 3 * 576 + math.ceil(3 * 576 / q8.BLOCK) * 4
    assert len(body) < len(exact) / 3.5
    frame = decode_frame(headers, body)
    assert frame.tensor.dtype == torch.float32 and frame.tensor.shape == (1, 3, 576)
    assert torch.allclose(frame.tensor, tensor, atol=float(tensor.abs().max()) / 127)
    half, half_body = encode_frame(tensor.to(torch.bfloat16), session="s-1", encoding="q8")
    assert decode_frame(half, half_body).tensor.dtype == torch.bfloat16


def test_a_q8_frame_with_a_wrong_body_length_or_an_unknown_encoding_is_refused() -> None:
    headers, body = encode_frame(torch.randn(1, 2, 64), session="s-1", encoding="q8")
    with pytest.raises(FrameError) as refused:
        decode_frame(headers, body + b"\0")
    assert refused.value.code == "bad_length"
    with pytest.raises(FrameError) as unknown:
        parse_frame_headers({**headers, h.ENCODING: "q4"})
    assert unknown.value.code == "bad_encoding"


def test_wire_dtype_is_a_node_setting_with_an_env_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NodeSettings().wire_dtype == "native"
    monkeypatch.setenv("MESHNET_WIRE_DTYPE", "int8")
    assert NodeSettings().wire_dtype == "int8"
    monkeypatch.setenv("MESHNET_WIRE_DTYPE", "int4")
    with pytest.raises(ValueError):
        NodeSettings()


def test_a_hop_that_refuses_a_frame_is_named_with_its_code() -> None:
    node = RouteNode(node_id="old", endpoint="http://x", shard_start=2, shard_end=3, start_layer=2)
    with pytest.raises(ChainFailure) as failure:
        judge_payload(node, 400, {"error": {"code": "bad_encoding", "message": "no q8"}}, None)
    assert failure.value.failed_node == "old" and failure.value.refused_code == "bad_encoding"


# --- the fallback: a next hop that does not know q8 ------------------------------------------------------------


class _OldHop:
    """A next hop that refuses every ``q8`` frame as a node without the encoding does (400 ``bad_encoding``)."""

    def __init__(self) -> None:
        self.encodings: list[str] = []

    async def send(self, node: RouteNode, headers: Mapping[str, str], body: bytes) -> ForwardAnswer:
        encoding = headers.get(h.ENCODING, "identity")
        self.encodings.append(encoding)
        if encoding == "q8":
            raise hop_failed(node.node_id, "answered 400 bad_encoding", "bad_encoding")
        decode_frame(headers, body)
        return ForwardAnswer(token=7, node_timings_ms={node.node_id: 1.0})


class _Runner:
    async def step(self, cache: Any, **_: Any) -> Any:
        from services.node.engine.step_engine import StepResult

        return StepResult(hidden=torch.randn(1, 1, 64), token=None, compute_ms=1.0)


class _Sessions:
    def ensure_room(self, session: Any, tokens: int) -> None:
        pass

    def touch(self, session: Any) -> None:
        pass


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        r = CollectorRegistry()
        self.compute_latency = Histogram("c", "c", registry=r)
        self.frame_bytes_sent = Counter("b", "b", ["encoding"], registry=r)
        self.frame_tokens_sent = Counter("t", "t", ["encoding"], registry=r)
        self.positions_computed = Counter("p", "p", registry=r)


def test_a_next_hop_without_q8_is_sent_exact_frames_from_then_on() -> None:
    from meshwire.forward_step import StepInfo

    old = _OldHop()
    stepper = RouteStepper(node_id="head", runner=_Runner(), sessions=_Sessions(), sender=old,  # type: ignore[arg-type]
                           metrics=_Metrics(), wire_dtype="int8")  # type: ignore[arg-type]
    node = RouteNode(node_id="old", endpoint="http://x", shard_start=2, shard_end=3, start_layer=2)
    onward = Onward(node, StepInfo(route_token="r", hop_index=1, start_layer=2, step=0, position_offset=0))

    class _Session:
        session_id = "s-1"
        cache = None

    async def go() -> None:
        for _ in range(2):
            done = await stepper.run(_Session(), position_offset=0, from_layer=0, tokens=1,  # type: ignore[arg-type]
                                     ids=[1], onward=onward)
            assert done.token == 7

    asyncio.run(go())
    assert old.encodings == ["q8", "identity", "identity"]


# --- a real mesh ------------------------------------------------------------------------------------------------


def _counter(service: Service, name: str, encoding: str) -> float:
    text = httpx.get(f"{service.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name + "_total" and sample.labels.get("encoding") == encoding:
                return sample.value
    return 0.0


def test_a_head_sending_q8_generates_along_a_route_and_sends_about_72_bytes_a_token(tiny_model_dir: Path) -> None:
    from meshwire.routes import Route, plan_start_layers, sign_route
    from tests.test_node_mesh import LAYERS, NUM_LAYERS  # the same split of the tiny model

    common = {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu"}
    front = start_service("node", {**common, **pinned_node_env("front"), "MESHNET_NODE_ID": "front", "MESHNET_LAYERS": "0-1",
                                   "MESHNET_WIRE_DTYPE": "int8"}, wait_ready=False)
    back = start_service("node", {**common, **pinned_node_env("back"), "MESHNET_NODE_ID": "back", "MESHNET_LAYERS": "2-3"},
                         wait_ready=False)
    try:
        wait_healthy(front)
        wait_healthy(back)
        model = httpx.get(f"{front.url}/health").json()["model"]
        hops = [RouteNode(node_id=name, endpoint=service.url, shard_start=LAYERS[name][0], shard_end=LAYERS[name][1],
                          start_layer=LAYERS[name][0], hop_key=node_hop_key(name).public_text)
                for name, service in (("front", front), ("back", back))]
        token = sign_route(Route(model=model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS), TEST_ROUTE_KEY)
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120,
                               default_headers={h.ROUTE: token})
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello river"}],
                                                max_tokens=12, temperature=0)
        assert answer.choices[0].message.content
        sent = _counter(front, "meshnet_node_frame_bytes_sent", "q8")
        positions = _counter(front, "meshnet_node_frame_tokens_sent", "q8")
        assert positions > 0 and _counter(front, "meshnet_node_frame_bytes_sent", "identity") == 0
        assert sent / positions == q8.q8_nbytes(64)  # 64 values and 2 scales: 72 bytes, float32 would be 256
    finally:
        front.stop()
        back.stop()
