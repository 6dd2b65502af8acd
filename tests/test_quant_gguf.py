"""Reading a GGUF's tensors for ``--weights``: the fast index agrees with gguf-py, blocks load as their own integers.

A small GGUF is written here with gguf-py (metadata of every kind, a token
list like a real model's, Q4_1, Q8_0 and F32 tensors under llama.cpp's
names), then read back by :mod:`services.node.model.quant.gguf_file` and
:class:`~services.node.model.quant.quant_load.GgufSource`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig

from services.node.model.quant.gguf_file import GgufError, GgufFile, read_index
from services.node.model.quant.packed import KERNEL_DTYPE
from services.node.model.quant.quant_load import GgufSource, gguf_format

HEADS, KV_HEADS, HIDDEN = 4, 2, 64
ROWS = {"q": HIDDEN, "k": HIDDEN // HEADS * KV_HEADS}


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"q": rng.standard_normal((ROWS["q"], HIDDEN), dtype=np.float32),
            "k": rng.standard_normal((ROWS["k"], HIDDEN), dtype=np.float32),
            "embd": rng.standard_normal((128, HIDDEN), dtype=np.float32),
            "norm": rng.standard_normal((HIDDEN,), dtype=np.float32)}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("test.scale", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_array("tokenizer.ggml.tokens", [f"token-{i}" for i in range(500)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(500)])
    w = _weights()
    for name, key, kind in (("blk.0.attn_q.weight", "q", "Q4_1"), ("blk.0.attn_k.weight", "k", "Q4_1"),
                            ("token_embd.weight", "embd", "Q8_0")):
        blocks = quantize(w[key], GGMLQuantizationType[kind])
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType[kind])
    writer.add_tensor("blk.0.attn_norm.weight", w["norm"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _config() -> LlamaConfig:
    return LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       num_hidden_layers=1, intermediate_size=128, vocab_size=128)


def test_the_index_agrees_with_gguf_py(gguf_path: Path) -> None:
    index, _ = read_index(gguf_path)
    theirs = {t.name: t for t in GGUFReader(str(gguf_path)).tensors}
    assert set(index) == set(theirs)
    mapped = GgufFile(gguf_path)
    for name, tensor in theirs.items():
        assert index[name].kind == tensor.tensor_type.name
        assert index[name].shape == tuple(int(n) for n in reversed(tensor.shape))
        assert np.array_equal(mapped.raw(name).reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GgufError, match="not a GGUF"):
        read_index(path)


def test_the_layers_format_is_read_from_their_block_type(gguf_path: Path) -> None:
    assert gguf_format(gguf_path) == "int4"


def test_q4_1_query_rows_load_unpermuted_as_transformers_loads_them(gguf_path: Path) -> None:
    source = GgufSource(gguf_path, _config())
    for key, rows, heads in (("q", ROWS["q"], HEADS), ("k", ROWS["k"], KV_HEADS)):
        name = f"model.layers.0.self_attn.{key}_proj.weight"
        blocks = quantize(_weights()[key], GGMLQuantizationType.Q4_1)
        file_values = torch.from_numpy(np.asarray(dequantize(blocks, GGMLQuantizationType.Q4_1), dtype=np.float32))
        # transformers' reverse permutation of llama.cpp's rotary row order
        expected = file_values.reshape(heads, rows // heads // 2, 2, HIDDEN).transpose(1, 2).reshape(rows, HIDDEN)
        loaded = source.float_tensor(name)
        assert loaded is not None and torch.allclose(loaded, expected, rtol=2.0 ** -7, atol=1e-2)
        groups = source.groups(name, "int4")
        assert groups is not None and groups.repeat == 1 and int(groups.q.max()) <= 15


def test_a_q8_0_embedding_packs_in_slices_to_its_own_values(gguf_path: Path) -> None:
    source = GgufSource(gguf_path, _config())
    matrix = source.matrix("model.embed_tokens.weight", "int8")
    assert matrix is not None and matrix.format == "int8" and matrix.out_features == 128
    blocks = quantize(_weights()["embd"], GGMLQuantizationType.Q8_0)
    file_values = torch.from_numpy(np.asarray(dequantize(blocks, GGMLQuantizationType.Q8_0), dtype=np.float32))
    scale = file_values.abs().amax()
    assert (matrix.dequantize() - file_values).abs().max() <= 2.0 ** -8 * scale
    ids = torch.tensor([0, 63, 64, 127])
    assert torch.equal(matrix.rows(ids, torch.float32), matrix.dequantize()[ids])
    x = torch.randn(2, HIDDEN)
    reference = x.to(KERNEL_DTYPE).float() @ matrix.dequantize().t()
    assert (matrix.matmul(x) - reference).abs().max() <= 2.0 ** -6 * reference.abs().max()


def test_a_float_tensor_reads_as_it_is(gguf_path: Path) -> None:
    norm = GgufSource(gguf_path, _config()).float_tensor("model.layers.0.input_layernorm.weight")
    assert norm is not None and torch.equal(norm, torch.from_numpy(_weights()["norm"]))
