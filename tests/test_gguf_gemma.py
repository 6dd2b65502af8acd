"""Gemma 2 and Gemma 3 from their GGUF ((1+w) norms around attention and MLP, embedding scaling, sliding
layers between global ones, soft-capped scores and logits):
every split of the layers in this process, and 1 and 2 real node processes given ``--model FILE.gguf``,
answer exactly as transformers does on the same weights (float32, greedy and seeded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf_mesh import Served, check_every_split, check_one_and_two_nodes, serve_family

FAMILIES = ("gemma2", "gemma3")
MESHED = FAMILIES


@pytest.fixture(scope="module", params=FAMILIES)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Served:
    return serve_family(request.param, tmp_path_factory.mktemp(request.param))


def test_every_split_of_the_gguf_answers_as_transformers(served: Served) -> None:
    check_every_split(served)


@pytest.mark.parametrize("family", MESHED)
def test_one_and_two_node_processes_answer_as_transformers(family: str, tmp_path: Path) -> None:
    check_one_and_two_nodes(family, tmp_path)
