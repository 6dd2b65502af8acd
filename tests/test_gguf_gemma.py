"""Gemma 2 and Gemma 3 from their GGUF ((1+w) norms around attention and MLP, embedding scaling, sliding
layers between global ones, soft-capped scores and logits):
every split of the layers in this process, and 1 and 2 real node processes given ``--model FILE.gguf``,
answer exactly as transformers does on the same weights (float32, greedy and seeded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf_mesh import (
    SAMPLING,
    SPLITS,
    Served,
    expected_text,
    gguf_mesh,
    reference,
    serve_family,
    shards_generate,
)
from tests.gguf_models import LAYERS

FAMILIES = ("gemma2", "gemma3")
MESHED = FAMILIES


@pytest.fixture(scope="module", params=FAMILIES)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    return serve_family(request.param, tmp_path_factory.mktemp(request.param))


def test_every_split_of_the_gguf_answers_as_transformers(served: Served) -> None:
    expected = reference(served)
    assert shards_generate(served, [(0, LAYERS - 1)]) == expected
    for first, cut, second, last in SPLITS:
        assert shards_generate(served, [(first, cut), (second, last)]) == expected, f"split after layer {cut}"


@pytest.mark.parametrize("family", MESHED)
def test_one_and_two_node_processes_answer_as_transformers(family: str, tmp_path: Path) -> None:
    served = serve_family(family, tmp_path)
    greedy, seeded = reference(served), reference(served, SAMPLING)
    with gguf_mesh(served) as mesh:
        for hops in (1, 2):
            assert mesh.answer(hops) == (expected_text(served, greedy), len(greedy)), f"{hops} node(s), greedy"
            assert mesh.answer(hops, SAMPLING) == (expected_text(served, seeded), len(seeded)), f"{hops}, seeded"
