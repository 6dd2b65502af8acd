"""A hop opening a session as a fork (``X-Meshnet-Fork-From``, ``meshwire.fork``): what it copies, what it refuses.

One real tail node (layers 2-3 of the tiny model, float32) takes frames for hop 1 of a route a test signs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import httpx
import pytest
import torch

from meshwire import headers as h
from meshwire.frames import encode_frame
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from tests.procs import TEST_ROUTE_KEY, TEST_SECRET, Service, node_hop_key, pinned_node_env, start_service

HIDDEN: Final = 64
PROMPT: Final = 6
LAYERS: Final = {"front": (0, 1), "back": (2, 3)}
GREEDY: Final = '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}'


@pytest.fixture(scope="module")
def back(tiny_model_dir: Path) -> Iterator[Service]:
    with start_service("node", {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32",
                                "MESHNET_DEVICE": "cpu", "MESHNET_LAYERS": "2-3", "MESHNET_NODE_ID": "back",
                                **pinned_node_env("back")}) as service:
        yield service


def route(back: Service, when: float) -> str:
    model = str(httpx.get(f"{back.url}/health").json()["model"])
    hops = [RouteNode(node_id=name, endpoint=back.url if name == "back" else "http://127.0.0.1:9",
                      shard_start=start, shard_end=end, start_layer=start, hop_key=node_hop_key(name).public_text)
            for name, (start, end) in LAYERS.items()]
    return sign_route(Route(model=model, nodes=plan_start_layers(hops), num_layers=4), TEST_ROUTE_KEY, now=when)


def post(back: Service, token: str, session: str, hidden: torch.Tensor, *, offset: int = 0, step: int = 0,
         fork: str | None = None) -> httpx.Response:
    extra = {h.ROUTE: token, h.HOP_INDEX: "1", h.START_LAYER: "2", h.STEP: str(step),
             h.POSITION_OFFSET: str(offset), h.SAMPLING: GREEDY, "Authorization": f"Bearer {TEST_SECRET}"}
    if step == 0:
        extra[h.RESERVE] = "32"
    if fork is not None:
        extra[h.FORK_FROM] = fork
    headers, body = encode_frame(hidden, session=session, extra=extra)
    return httpx.post(f"{back.url}/forward", headers=headers, content=body, timeout=30)


def hidden(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn((1, tokens, HIDDEN), generator=torch.Generator().manual_seed(seed))


def test_a_fork_copies_the_sources_rows_and_samples_what_a_prefill_would(back: Service) -> None:
    mine = route(back, time.time())
    prompt = hidden(PROMPT, 1)
    plain = post(back, mine, "s-plain", prompt)
    assert plain.status_code == 200, plain.text
    source = post(back, mine, "s-source", prompt)
    assert source.status_code == 200
    assert post(back, mine, "s-source", hidden(1, 2), offset=PROMPT, step=1).status_code == 200  # it goes on
    forked = post(back, mine, "s-fork", prompt[:, -1:], offset=PROMPT - 1, fork=f"n={PROMPT - 1};s=s-source")
    assert forked.status_code == 200, forked.text
    assert forked.json()["token"] == plain.json()["token"], "the fork samples from the logits a prefill gives"
    after = post(back, mine, "s-fork", hidden(1, 3), offset=PROMPT, step=1)
    again = post(back, mine, "s-plain", hidden(1, 3), offset=PROMPT, step=1)
    assert after.json()["token"] == again.json()["token"], "and goes on as the plain session does"


@pytest.mark.parametrize("case", ["another_route", "too_short", "unknown", "closed"])
def test_a_fork_the_hop_cannot_make_is_refused_and_opens_nothing(back: Service, case: str) -> None:
    mine, other = route(back, time.time()), route(back, time.time() - 1)
    source = f"s-src-{case}"
    assert post(back, mine, source, hidden(PROMPT, 4)).status_code == 200
    if case == "closed":
        closed = httpx.post(f"{back.url}/forward", headers={
            h.CONTROL: "close", h.WIRE: h.WIRE_VERSION, h.SESSION: source, h.ROUTE: mine, h.HOP_INDEX: "1",
            h.START_LAYER: "2", "Authorization": f"Bearer {TEST_SECRET}"}, timeout=30)
        assert closed.status_code == 200, closed.text
    token = other if case == "another_route" else mine
    positions = PROMPT + 3 if case == "too_short" else PROMPT - 1
    named = "s-nobody" if case == "unknown" else source
    refused = post(back, token, f"s-f-{case}", hidden(1, 5), offset=positions, fork=f"n={positions};s={named}")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "fork_refused", refused.text
    retry = post(back, token, f"s-f-{case}", hidden(1, 5), offset=positions, step=1)
    assert retry.status_code == 409 and retry.json()["error"]["code"] == "unknown_session", "nothing was opened"
