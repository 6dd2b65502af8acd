"""The tensor index of a GGUF file, read in milliseconds, and each tensor's bytes as a memory-mapped view.

gguf-py's ``GGUFReader`` builds a numpy view for every metadata value,
including the two 49,152-entry token lists of the default model: 17 s on a
busy 2-core machine, twice per node start. A node only needs where each
tensor lies, so :func:`read_index` walks the header with :mod:`struct`,
skipping metadata values without building them, and :class:`GgufFile`
maps the file once and hands out each tensor's bytes without copying them.

Format (GGUF v2/v3, little-endian): magic ``GGUF``, version (u32), tensor
count and metadata count (u64), the metadata key/value pairs, then per
tensor its name, dimensions (innermost first), ggml type and offset from
the data section, which starts at the next multiple of
``general.alignment`` (32 by default).
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC: Final = b"GGUF"
VERSIONS: Final = frozenset({2, 3})
DEFAULT_ALIGNMENT: Final = 32
MAX_TENSORS: Final = 1 << 20
MAX_METADATA: Final = 1 << 20
MAX_DIMS: Final = 4
MAX_STRING_BYTES: Final = 1 << 24
PAGE: Final = mmap.PAGESIZE
_SCALARS: Final = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""Byte size of each fixed-size metadata value type."""
_STRING: Final = 8
_ARRAY: Final = 9
_UINT32: Final = 4


class GgufError(ValueError):
    """The file is not a GGUF this reader understands."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: its ggml type name, shape (outermost first, as torch has it) and bytes."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _read(handle: BinaryIO, fmt: str) -> tuple[int, ...]:
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise GgufError("the file ends inside its header")
    return struct.unpack(fmt, data)


def _string(handle: BinaryIO) -> bytes:
    (length,) = _read(handle, "<Q")
    if length > MAX_STRING_BYTES:
        raise GgufError(f"a header string of {length} bytes")
    return handle.read(length)


def _skip_value(handle: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        handle.seek(_SCALARS[kind], 1)
    elif kind == _STRING:
        (length,) = _read(handle, "<Q")
        handle.seek(length, 1)
    elif kind == _ARRAY:
        item, count = _read(handle, "<IQ")
        if item in _SCALARS:
            handle.seek(_SCALARS[item] * count, 1)
        else:
            for _ in range(count):
                _skip_value(handle, item)
    else:
        raise GgufError(f"unknown metadata value type {kind}")


def read_architecture(path: Path) -> str | None:
    """The file's ``general.architecture``, read from the header alone."""
    with path.open("rb") as handle:
        if handle.read(4) != MAGIC:
            raise GgufError(f"{path} is not a GGUF file")
        version, _, metadata = _read(handle, "<IQQ")
        if version not in VERSIONS or metadata > MAX_METADATA:
            raise GgufError(f"{path}: GGUF version {version} is not supported")
        for _ in range(metadata):
            key = _string(handle)
            (kind,) = _read(handle, "<I")
            if key == b"general.architecture" and kind == _STRING:
                return _string(handle).decode("utf-8", errors="replace")
            _skip_value(handle, kind)
    return None


def read_index(path: Path) -> tuple[dict[str, TensorEntry], int]:
    """Every tensor of the GGUF at ``path`` by name, and the file offset of its data section."""
    with path.open("rb") as handle:
        if handle.read(4) != MAGIC:
            raise GgufError(f"{path} is not a GGUF file")
        version, tensors, metadata = _read(handle, "<IQQ")
        if version not in VERSIONS or tensors > MAX_TENSORS or metadata > MAX_METADATA:
            raise GgufError(f"{path}: GGUF version {version} with {tensors} tensors is not supported")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(metadata):
            key = _string(handle)
            (kind,) = _read(handle, "<I")
            if key == b"general.alignment" and kind == _UINT32:
                (alignment,) = _read(handle, "<I")
            else:
                _skip_value(handle, kind)
        entries: dict[str, TensorEntry] = {}
        for _ in range(tensors):
            name = _string(handle).decode("utf-8")
            (dims,) = _read(handle, "<I")
            if not 1 <= dims <= MAX_DIMS:
                raise GgufError(f"tensor {name} has {dims} dimensions")
            shape = tuple(reversed(_read(handle, f"<{dims}Q")))
            kind_id, offset = _read(handle, "<IQ")
            try:
                kind = GGMLQuantizationType(kind_id)
            except ValueError as exc:
                raise GgufError(f"tensor {name} has unknown ggml type {kind_id}") from exc
            block, block_bytes = GGML_QUANT_SIZES[kind]
            count = int(np.prod(shape))
            entries[name] = TensorEntry(name=name, kind=kind.name, shape=shape, offset=offset,
                                        nbytes=count // block * block_bytes)
        start = handle.tell()
    return entries, (start + alignment - 1) // alignment * alignment


SPLIT_NAME: Final = re.compile(r"(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf")
"""llama.cpp's ``gguf-split`` naming: ``model-00001-of-00003.gguf`` and its siblings."""
MAX_SPLIT_PARTS: Final = 1024


def split_parts(path: Path) -> list[Path]:
    """Every file of the set ``path`` belongs to, in order (``[path]`` for a single file); a part missing is an
    error naming it, and so is a set named by other than its first file."""
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if int(match["part"]) != 1 or not 1 <= count <= MAX_SPLIT_PARTS:
        raise GgufError(f"{path.name} is part {int(match['part'])} of {count}: name the first part of a split GGUF")
    parts = [path.with_name(f"{match['stem']}-{index:05d}-of-{count:05d}.gguf") for index in range(1, count + 1)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise GgufError(f"the split GGUF {path.name} lacks {len(missing)} of its {count} parts, e.g. {missing[0]}")
    return parts


class GgufFile:
    """A GGUF file (or a split set, named by its first part) mapped read-only; :meth:`raw` is a tensor's bytes as
    ``uint8 [rows, bytes a row]``. Only the pages of the tensors read are ever brought into memory, and
    :meth:`release` (or reading through :meth:`borrowed`) takes a tensor's pages out of this process's resident
    memory again once its bytes have been copied into what the node holds.

    Why: a mapped page that was read counts in the process's RSS (``RssFile``) for as long as the mapping
    lives, so a node packing a third of Llama-3.1-8B's Q4_K_M file held the 1.7 GB of file pages it had read on
    top of its packed weights until the load ended (its peak RSS was both). Released, they stay in the page
    cache (another node or a restart reads them without the disk) but not in this process.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors: dict[str, TensorEntry] = {}
        self._where: dict[str, tuple[np.ndarray, int]] = {}
        self._maps: list[mmap.mmap] = []
        self._part: dict[str, int] = {}
        for index, part in enumerate(split_parts(path)):
            tensors, data = read_index(part)
            with part.open("rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append(mapped)
            view = np.frombuffer(mapped, dtype=np.uint8)
            for name, entry in tensors.items():
                self.tensors[name] = entry
                self._where[name] = (view, data)
                self._part[name] = index

    def release(self, name: str) -> None:
        """Drop the pages of tensor ``name`` from this process's resident memory (``MADV_DONTNEED``: the mapping
        is read-only and file-backed, so a later read of them faults them in again from the page cache)."""
        entry = self.tensors[name]
        mapped, data = self._maps[self._part[name]], self._where[name][1]
        begin = (data + entry.offset) // PAGE * PAGE
        end = min(len(mapped), data + entry.offset + entry.nbytes)
        if end > begin and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    @contextmanager
    def borrowed(self, name: str) -> Iterator[np.ndarray]:
        """:meth:`raw` of tensor ``name`` for the ``with`` block, its pages released (:meth:`release`) after it:
        for a caller that copies what it needs out of the bytes."""
        try:
            yield self.raw(name)
        finally:
            self.release(name)

    def raw(self, name: str) -> np.ndarray:
        entry = self.tensors[name]
        view, data = self._where[name]
        begin = data + entry.offset
        if begin + entry.nbytes > view.size:
            raise GgufError(f"tensor {name} lies beyond the end of its file ({self.path})")
        rows = int(np.prod(entry.shape[:-1])) if len(entry.shape) > 1 else 1
        return view[begin:begin + entry.nbytes].reshape(rows, -1)
