"""``--activations int8`` on a real node: an int4 node of the tiny model quantizes its products' rows to int8.

One node holds every layer with ``MESHNET_WEIGHTS=int4`` and ``MESHNET_ACTIVATIONS=int8``; its greedy answer is
what the same shard answers in this process with int8 activations chosen (the int8 product gives a row the same
bits whatever rows ride with it and on every instruction-set path: tests/test_q8_kernel.py), and its log says
which rows it took. The exactness tests keep float32 rows (tests.procs pins ``MESHNET_ACTIVATIONS=float32``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from meshwire import headers as h
from meshwire.limits import ROUTE_TTL_S
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from services.node.model.quant import quant_kernel
from services.node.model.shard_load import load_shard
from tests.procs import TEST_ROUTE_KEY, TEST_SECRET, Service, node_hop_key, pinned_node_env, start_service
from tests.requirements import needs

pytestmark = needs(quant_kernel.available(), "meshnet's native kernel did not build here (a C++ compiler: `make kernels`)")

NUM_LAYERS = 4
MAX_TOKENS = 12
PROMPT = [{"role": "user", "content": "Where does the river run before it reaches the sea?"}]


@pytest.fixture(scope="module")
def int8_node(tiny_model_dir: Path) -> Iterator[Service]:
    node = start_service("node", {
        "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
        "MESHNET_WEIGHTS": "int4", "MESHNET_ACTIVATIONS": "int8", "MESHNET_NODE_ID": "int8",
        "MESHNET_LAYERS": f"0-{NUM_LAYERS - 1}", **pinned_node_env("int8")})
    try:
        yield node
    finally:
        node.stop()


def _client(node: Service) -> tuple[openai.OpenAI, str]:
    model = httpx.get(f"{node.url}/health").json()["model"]
    hop = RouteNode(node_id="int8", endpoint=node.url, shard_start=0, shard_end=NUM_LAYERS - 1, start_layer=0,
                    hop_key=node_hop_key("int8").public_text)
    token = sign_route(Route(model=model, nodes=plan_start_layers([hop]), num_layers=NUM_LAYERS), TEST_ROUTE_KEY,
                       ttl_s=ROUTE_TTL_S)
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key=TEST_SECRET, max_retries=0, timeout=120,
                         default_headers={h.ROUTE: token}), model


def in_process_answer(folder: Path, activations: str) -> str:
    """The same int4 shard's greedy answer in this process with ``activations`` rows."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    stops = GenerationConfig.from_pretrained(folder).eos_token_id
    stops = {stops} if isinstance(stops, int) else set(stops or ())
    shard = load_shard(folder, 0, NUM_LAYERS - 1, torch.float32, torch.device("cpu"), weights="int4")
    cache = shard.new_cache()
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    new: list[int] = []
    quant_kernel.choose_activations(activations)
    try:
        while len(new) < MAX_TOKENS:
            token = int(shard.logits_last(shard.run_layers(shard.embed(ids), cache, cache.seq_len)).argmax())
            if token in stops:
                break
            new.append(token)
            ids = torch.tensor([[token]])
    finally:
        quant_kernel.choose_activations("float32")
    return tokenizer.decode(new, skip_special_tokens=True)


def test_an_int8_activations_node_answers_what_the_same_shard_answers_with_int8_rows(
        int8_node: Service, tiny_model_dir: Path) -> None:
    client, model = _client(int8_node)
    answer = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].message.content == in_process_answer(tiny_model_dir, "int8")
    assert "quantized layers take int8 activations (asked for)" in int8_node.log()
