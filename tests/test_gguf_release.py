"""A node reading its tensors from a mapped GGUF does not keep the file's pages in its resident memory.

A read page of a mapping counts in the process's RSS for as long as the mapping lives: a node packing a third
of Llama-3.1-8B's Q4_K_M file held the 1.7 GB of file pages it had read beside its packed weights. Each
tensor's pages are released (``MADV_DONTNEED``) once its bytes are copied; these tests read the mapping's own
resident size from ``/proc/self/smaps``.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from services.node.model.gguf_model import GgufWeights
from services.node.model.quant.gguf_file import GgufFile

ROWS, COLS = 1024, 1024
"""A 4 MiB float32 tensor: a thousand pages."""


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of every mapping of ``path`` in this process."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gguf

    path = tmp_path_factory.mktemp("release") / "two.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((ROWS, COLS), dtype=np.float32))
    writer.add_tensor("blk.0.attn_k.weight", rng.standard_normal((ROWS, COLS), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.resolve()


def test_a_read_tensors_pages_stay_resident_until_released(gguf_file: Path) -> None:
    file = GgufFile(gguf_file)
    touched = float(file.raw("blk.0.attn_q.weight").sum())  # brings its pages in
    assert math.isfinite(touched)
    assert _mapped_rss_kib(gguf_file) >= ROWS * COLS * 4 // 1024 * 0.9
    file.release("blk.0.attn_q.weight")
    assert _mapped_rss_kib(gguf_file) < 64


def test_borrowed_bytes_are_released_and_what_was_copied_is_intact(gguf_file: Path) -> None:
    file = GgufFile(gguf_file)
    with file.borrowed("blk.0.attn_k.weight") as raw:
        copy = np.array(raw.view(np.float32))
        assert _mapped_rss_kib(gguf_file) >= ROWS * COLS * 4 // 1024 * 0.9
    assert _mapped_rss_kib(gguf_file) < 64
    assert np.array_equal(copy, file.raw("blk.0.attn_k.weight").view(np.float32))  # faulted in again, same bytes


def test_a_shard_reading_its_weights_keeps_none_of_the_files_pages(gguf_file: Path) -> None:
    config = SimpleNamespace(model_type="qwen2", num_attention_heads=8, num_key_value_heads=8)
    with GgufWeights(gguf_file, config) as weights:  # type: ignore[arg-type]
        tensors = [weights.read(name) for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight")]
        assert _mapped_rss_kib(gguf_file) < 64
    assert all(tuple(t.shape) == (ROWS, COLS) for t in tensors)
