"""Checks shared by the per-family GGUF tests: a tiny GGUF model served by shards in this process and by
real node processes on 1 and 2 nodes, against transformers ``generate`` on the same weights.

The prompt's ids come from the tokenizer the node read from the file (the folder
:func:`~services.node.model.gguf_model.prepare_gguf_folder` wrote), so both sides
start from the same ids whatever the architecture's tokenizer class makes of the
suite's tiny vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from meshwire import headers as h
from meshwire.limits import ROUTE_TTL_S
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from services.node.model.gguf_model import prepare_gguf_folder
from services.node.model.shard_load import load_shard
from tests.gguf_models import LAYERS, GgufModel, build_gguf_model
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_SECRET,
    Service,
    named_nodes,
    node_hop_key,
)

MESSAGES: Final = [{"role": "user", "content": "Where does the river run before it reaches the sea?"}]
NEW_TOKENS: Final = 12
SAMPLING: Final = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 1234}
SPLITS: Final = tuple((0, cut, cut + 1, LAYERS - 1) for cut in range(LAYERS - 1))
"""Every two-shard split of the tiny models' layers."""
NODES: Final = {"full": (0, LAYERS - 1), "front": (0, 1), "back": (2, LAYERS - 1)}
ROUTES: Final = {1: ("full",), 2: ("front", "back")}
LOGITS_TOLERANCE: Final = 1e-4
"""Llama 3's rope from the file's divisors differs from transformers' own formula in the last bits (1e-5 on a
logit); a missing soft-cap or rope scaling moves logits by far more."""


@dataclass(frozen=True)
class Served:
    """A tiny GGUF model, its metadata folder, and the prompt as the node tokenizes it."""

    gguf: GgufModel
    folder: Path
    cache: Path
    tokenizer: PreTrainedTokenizerBase
    prompt: torch.Tensor


def serve_family(family: str, dest: Path, quant: str | None = None) -> Served:
    """Write ``family``'s tiny GGUF under ``dest`` (in ``quant``'s format: :func:`build_gguf_model`) and prepare
    its folder as a node would."""
    made = build_gguf_model(family, dest, quant=quant)
    cache = dest / "cache"
    folder = prepare_gguf_folder(made.path, cache)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    return Served(gguf=made, folder=folder, cache=cache, tokenizer=tokenizer, prompt=prompt)


def reference(served: Served, sampling: dict[str, Any] | None = None, tokens: int = NEW_TOKENS,
              prompt: torch.Tensor | None = None) -> list[int]:
    """What transformers ``generate`` makes of ``prompt`` (default: the served prompt) on the same weights
    (greedy, or seeded sampling)."""
    prompt = served.prompt if prompt is None else prompt
    kwargs: dict[str, Any] = {"do_sample": False}
    if sampling is not None:
        torch.manual_seed(sampling["seed"])
        kwargs = {"do_sample": True, "temperature": sampling["temperature"], "top_p": sampling["top_p"],
                  "top_k": sampling["top_k"]}
    out = served.gguf.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                     pad_token_id=served.gguf.model.config.pad_token_id, **kwargs)
    return out[0, prompt.shape[1]:].tolist()


def shards_generate(served: Served, ranges: list[tuple[int, int]], tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of shards of ``ranges`` loaded in this process from the GGUF, chained by hand; the logits
    after the prompt must be transformers' own (soft-capping, which greedy tokens cannot see, included)."""
    shards = [load_shard(served.folder, start, end, torch.float32, torch.device("cpu")) for start, end in ranges]
    caches = [shard.new_cache() for shard in shards]
    step, position, out = served.prompt, 0, []
    for _ in range(tokens):
        hidden = shards[0].embed(step)
        for shard, cache in zip(shards, caches, strict=True):
            hidden = shard.run_layers(hidden, cache, position)
        logits = shards[-1].logits_last(hidden)
        if position == 0:
            with torch.no_grad():
                expected = served.gguf.model(step).logits[0, -1]
            torch.testing.assert_close(logits, expected, rtol=LOGITS_TOLERANCE, atol=LOGITS_TOLERANCE)
        position += step.shape[1]
        out.append(int(logits.argmax()))
        step = torch.tensor([[out[-1]]])
    return out


@dataclass
class GgufMesh:
    """Node processes serving one GGUF: ``full`` alone, ``front -> back`` split between layers 1 and 2."""

    nodes: dict[str, Service]
    model: str

    def client(self, hops: int) -> openai.OpenAI:
        names = ROUTES[hops]
        entries = [RouteNode(node_id=name, endpoint=self.nodes[name].url, shard_start=NODES[name][0],
                             shard_end=NODES[name][1], start_layer=NODES[name][0],
                             hop_key=node_hop_key(name).public_text) for name in names]
        route = sign_route(Route(model=self.model, nodes=plan_start_layers(entries), num_layers=LAYERS),
                           TEST_ROUTE_KEY, ttl_s=ROUTE_TTL_S)
        return openai.OpenAI(base_url=f"{self.nodes[names[0]].url}/v1", api_key=TEST_SECRET, max_retries=0,
                             timeout=120, default_headers={h.ROUTE: route})

    def answer(self, hops: int, sampling: dict[str, Any] | None = None, tokens: int = NEW_TOKENS) -> tuple[str, int]:
        """The chat answer's text and token count on the ``hops``-node route."""
        args: dict[str, Any] = {"temperature": 0}
        if sampling is not None:
            args = {"temperature": sampling["temperature"], "top_p": sampling["top_p"], "seed": sampling["seed"],
                    "extra_body": {"top_k": sampling["top_k"]}}
        done = self.client(hops).chat.completions.create(model=self.model, messages=MESSAGES, max_tokens=tokens,
                                                         **args)
        assert done.usage is not None
        return done.choices[0].message.content or "", done.usage.completion_tokens


@contextlib.contextmanager
def gguf_mesh(served: Served, extra: dict[str, str] | None = None) -> Iterator[GgufMesh]:
    """The three nodes of :class:`GgufMesh` as real processes given ``--model FILE.gguf`` (and ``extra``
    settings); stopped afterwards."""
    common = {"MESHNET_MODEL": str(served.gguf.path), "MESHNET_MODEL_CACHE_DIR": str(served.cache),
              "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu", **(extra or {})}
    with named_nodes(NODES, common) as nodes:
        yield GgufMesh(nodes=nodes, model=httpx.get(f"{nodes['full'].url}/health").json()["model"])


def expected_text(served: Served, tokens: list[int]) -> str:
    return served.tokenizer.decode(tokens, skip_special_tokens=True)


def check_every_split(served: Served) -> None:
    """The whole model in one shard, then every two-shard split, each generates what transformers does."""
    expected = reference(served)
    assert shards_generate(served, [(0, LAYERS - 1)]) == expected
    for first, cut, second, last in SPLITS:
        assert shards_generate(served, [(first, cut), (second, last)]) == expected, f"split after layer {cut}"


def check_one_and_two_nodes(family: str, dest: Path) -> None:
    """One and two real node processes given the family's GGUF answer as transformers does, greedy and seeded."""
    served = serve_family(family, dest)
    greedy, seeded = reference(served), reference(served, SAMPLING)
    with gguf_mesh(served) as mesh:
        for hops in (1, 2):
            assert mesh.answer(hops) == (expected_text(served, greedy), len(greedy)), f"{hops} node(s), greedy"
            assert mesh.answer(hops, SAMPLING) == (expected_text(served, seeded), len(seeded)), f"{hops}, seeded"
