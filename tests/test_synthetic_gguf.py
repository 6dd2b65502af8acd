"""The big-model benchmark's synthetic Q4_K_M files (``benchmarks/synthetic_gguf.py``) and its bookkeeping
(``benchmarks/big_gguf.py``): llama.cpp's type mix, blocks of the intended scale, the padded vocabulary, and each
node's share of the file. No timing is measured here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.big_gguf import node_shares, ready_seconds
from benchmarks.mesh import split_layers
from benchmarks.synthetic_gguf import BigShape, q4_k_m_type, use_more_bits, write_big_shape

TINY = BigShape("tiny-dense", "llama", layers=8, hidden=512, heads=4, kv_heads=2, head_dim=128, inner=768,
                vocab=1000, rope_base=10_000.0, context=512)
TINY_MOE = BigShape("tiny-moe", "qwen3moe", layers=2, hidden=256, heads=2, kv_heads=1, head_dim=128, inner=256,
                    vocab=1000, rope_base=10_000.0, context=512, experts=4, used=2)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("synthetic")
    return {shape.name: write_big_shape(shape, folder, progress=lambda _: None) for shape in (TINY, TINY_MOE)}


def test_the_type_mix_is_llama_cpps_q4_k_m_for_llama_3_8b() -> None:
    # llama.cpp's Q4_K_M of a 32-layer model: attn_v and ffn_down in Q6_K in the first and last four layers and
    # every third between (layers 6, 9, ..., 27): 16 layers; the rest Q4_K, the LM head Q6_K.
    wider = [layer for layer in range(32) if use_more_bits(layer, 32)]
    assert wider == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert {q4_k_m_type("ffn_down", layer, 32) for layer in wider} == {"Q6_K"}
    assert q4_k_m_type("attn_v", 4, 32) == q4_k_m_type("ffn_down", 5, 32) == "Q4_K"
    assert {q4_k_m_type(name, 0, 32) for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert q4_k_m_type("output", 0, 32) == "Q6_K"
    assert q4_k_m_type("ffn_down_exps", 0, 12) == "Q6_K" and q4_k_m_type("ffn_up_exps", 0, 12) == "Q4_K"


def test_every_matrix_has_its_q4_k_m_type_and_weights_of_a_trained_layers_scale(written: dict[str, Path]) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    for shape in (TINY, TINY_MOE):
        reader = GGUFReader(written[shape.name])
        seen = set()
        for tensor in reader.tensors:
            name = tensor.name
            if name.endswith("norm.weight") or ".ffn_gate_inp." in name:
                assert tensor.tensor_type.name == "F32"
                continue
            kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
            layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
            expected = "Q4_K" if kind == "token_embd" else q4_k_m_type(kind, layer, shape.layers)
            assert tensor.tensor_type.name == expected, name
            seen.add(expected)
            values = dequantize(tensor.data, tensor.tensor_type)  # gguf-py's own decoder, not ours
            inputs = values.shape[-1]
            live = values[np.abs(values).sum(axis=-1) > 0]
            assert abs(float(live.std()) * np.sqrt(inputs) - 1) < 0.1, name
            assert abs(float(live.mean())) < 0.05 / np.sqrt(inputs), name
        assert seen == {"Q4_K", "Q6_K"}


def test_the_vocabulary_is_padded_and_the_end_of_text_rows_of_the_lm_head_are_silent(written: dict[str, Path]) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from tests.tiny_model import END_OF_TEXT, IM_END, _build_tokenizer

    reader = GGUFReader(written[TINY.name])
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == TINY.vocab
    tokenizer = _build_tokenizer()
    head = next(t for t in reader.tensors if t.name == "output.weight")
    rows = dequantize(head.data, head.tensor_type)
    assert rows.shape == (TINY.vocab, TINY.hidden)
    for token in (IM_END, END_OF_TEXT):
        assert not rows[tokenizer.convert_tokens_to_ids(token)].any()
    assert int((np.abs(rows).sum(axis=1) == 0).sum()) == 2


def test_a_file_is_written_once_and_then_reused(written: dict[str, Path]) -> None:
    path = written[TINY.name]
    stamp = path.stat().st_mtime_ns
    assert write_big_shape(TINY, path.parent, progress=lambda _: None) == path
    assert path.stat().st_mtime_ns == stamp
    assert not list(path.parent.glob("*.partial"))


def test_node_shares_split_the_files_tensors_between_the_nodes(written: dict[str, Path]) -> None:
    from services.node.model.quant.gguf_file import read_index

    path = written[TINY.name]
    ranges = split_layers(TINY.layers, 3)
    shares = node_shares(path, ranges)
    tensors, _ = read_index(path)
    assert sum(shares) == sum(t.nbytes for t in tensors.values())  # every tensor held once, by one node
    layer_bytes = [sum(t.nbytes for name, t in tensors.items() if name.startswith(f"blk.{layer}."))
                   for layer in range(TINY.layers)]
    own = [sum(layer_bytes[a:b + 1]) for a, b in ranges]
    assert shares[0] - own[0] == tensors["token_embd.weight"].nbytes  # the embedding at the head
    assert shares[1] == own[1]
    assert shares[2] - own[2] == tensors["output.weight"].nbytes + tensors["output_norm.weight"].nbytes


def test_a_nodes_load_time_is_read_from_its_ready_line() -> None:
    line = "01:02:03 INFO services.node.runtime: node n1 ready in 12.5 s: llama layers 0-10 of 32 on cpu"
    assert ready_seconds("starting\n" + line + "\n") == 12.5
    assert ready_seconds("starting\n") is None


def test_the_outcome_judges_each_nodes_rss_by_its_share_and_the_decode_by_llama_cpps(tmp_path: Path) -> None:
    from benchmarks.big_gguf import Plan, _outcome
    from benchmarks.timing import StreamTiming

    path = tmp_path / "model.gguf"
    path.write_bytes(b"0" * 1000)
    mesh = [StreamTiming(tokens=9, first_s=2.0, last_s=6.0), StreamTiming(tokens=9, first_s=3.0, last_s=7.0)]
    llama = [StreamTiming(tokens=9, first_s=4.0, last_s=8.0), StreamTiming(tokens=9, first_s=4.0, last_s=12.0)]
    nodes = [{"layers": "0-3", "share_mib": 1000.0, "VmRSS": 1300.0, "load_s": 5.0, "rss_after_rounds_mib": 1350.0},
             {"layers": "4-7", "share_mib": 1000.0, "VmRSS": 1300.0, "load_s": None, "rss_after_rounds_mib": 1500.0}]
    outcome = _outcome(Plan("gguf_8b", "llama-8b", 2, 2, 9), TINY, path, "2 nodes", "llama.cpp, 2 threads",
                       {"2 nodes": mesh, "llama.cpp, 2 threads": llama}, nodes, 60.0, [1.5, 1.4], 512, 9, 2, ())
    rows = {row.label.split(", ", 1)[1]: row for row in outcome.rows}
    assert rows["2 nodes: decode after a 512-token prompt"].value.median == 2.0  # 8 tokens after the first in 4 s
    ratio = rows["2 nodes / llama.cpp: decode"]
    assert ratio.value.median == 2.0 / 1.5 and "met" in ratio.note and "NOT" not in ratio.note
    assert rows["llama.cpp / 2 nodes: time to first token"].value.median == 4.0 / 2.5
    assert "NOT" not in rows["node 0 (layers 0-3): RSS after warm-up"].note  # 1,350 <= 1,000 + 400
    assert "NOT within" in rows["node 1 (layers 4-7): RSS after warm-up"].note  # 1,500 after the rounds
    assert "node 0: load time" in rows and "node 1: load time" not in rows
