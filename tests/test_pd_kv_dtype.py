"""Prefill/decode with 16-bit KV caches (``--kv-dtype float16``) on int4 nodes, as real processes.

The prefill node keeps the prompt's KV in float16 and registers that layout;
a decode node that keeps float16 too pulls it (half the bytes of float32) and
answers what it answers when it prefills the prompt itself. A decode node that
keeps float32 refuses the float16 group's layout, says why, and prefills the
prompt itself: the answer is the same as its plain path's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoConfig

from tests.pd_mesh import PdMesh, start_pd_mesh
from tests.test_pd_handoff import LONG, chat, counters, delta, plain_chat

INT4_HALF_KV = {"MESHNET_WEIGHTS": "int4", "MESHNET_KV_DTYPE": "float16"}
INT4_FLOAT_KV = {"MESHNET_WEIGHTS": "int4"}
FLOAT16_BYTES = 2


def _mesh(model_dir: Path, decode_env: dict[str, str]) -> PdMesh:
    mesh = start_pd_mesh(model_dir, {"p": (0, 3)}, {"d": (0, 3)}, node_env={"p": INT4_HALF_KV, "d": decode_env})
    mesh.extra.update(prefill=["p"], decode=["d"])
    return mesh


@pytest.fixture()
def same_format(tiny_model_dir: Path) -> Iterator[PdMesh]:
    mesh = _mesh(tiny_model_dir, INT4_HALF_KV)
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture()
def other_format(tiny_model_dir: Path) -> Iterator[PdMesh]:
    mesh = _mesh(tiny_model_dir, INT4_FLOAT_KV)
    try:
        yield mesh
    finally:
        mesh.stop()


def test_a_float16_cache_is_handed_off_at_half_width_and_answers_as_the_plain_path(
        same_format: PdMesh, tiny_model_dir: Path) -> None:
    mesh = same_format
    before = counters(mesh)
    pulled_before = mesh.metric("d", "meshnet_node_kv_pulled_bytes_total")
    text, _ = chat(mesh, LONG, None)
    after = counters(mesh)
    assert delta(after, before, "d", "handoff") == 1 and delta(after, before, "d", "fallback") == 0
    prompt_positions = delta(after, before, "p", "positions")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * FLOAT16_BYTES
    assert mesh.metric("d", "meshnet_node_kv_pulled_bytes_total") - pulled_before == prompt_positions * per_position
    assert plain_chat(mesh, LONG, None) == text


def test_a_decode_node_keeping_float32_refuses_the_float16_group_and_prefills_itself(other_format: PdMesh) -> None:
    mesh = other_format
    before = counters(mesh)
    text, _ = chat(mesh, LONG, None)
    after = counters(mesh)
    assert delta(after, before, "d", "fallback") == 1 and delta(after, before, "d", "handoff") == 0
    assert delta(after, before, "p", "positions") == 0
    assert mesh.metric("d", "meshnet_node_pd_fallbacks_total", reason="layout_mismatch") == 1
    assert ("refusing the prefill group's KV: the prefill group keeps KV with dtype float16, this node with "
            "dtype float32") in mesh.nodes["d"].log()
    assert plain_chat(mesh, LONG, None) == text
