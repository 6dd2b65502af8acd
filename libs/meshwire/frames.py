"""Activation frames: a raw tensor body plus ``X-Meshnet-*`` headers.

A frame is what one hop sends the next: the hidden states of some tokens of
one session. The body is the tensor's raw little-endian bytes in C order
(bfloat16 as its raw 16-bit pattern), optionally zlib-compressed; the headers
say how to read it. This is the reference node server's wire format, version
:data:`~meshwire.headers.WIRE_VERSION`. Besides ``zlib``, a sender on a slow
link may quantise the body to 8 bits a value (``q8``, :mod:`meshwire.q8`);
the receiver decodes it to the dtype the headers announce.

The receiving side never trusts a frame: :func:`check_frame_headers` refuses
a bad frame from its headers alone, before the body is read, and
:func:`decode_frame` refuses a body that does not match them. Every refusal
is a :class:`FrameError` whose ``code`` a node puts into its 400 answer.
Decompression is bounded by the size the headers announce, so a zip bomb
costs the receiver nothing.
"""

from __future__ import annotations

import math
import re
import sys
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal, get_args

import torch

from meshwire import headers as h
from meshwire import limits, q8
from meshwire.fields import DType

__all__ = [
    "DType", "Encoding", "Frame", "FrameError", "FrameErrorCode", "FrameLimits", "FrameSpec",
    "body_bound", "check_frame_headers", "decode_frame", "encode_frame", "format_attn_mask", "format_int_list",
    "format_position_ids", "format_shape", "get_header", "parse_attn_mask", "parse_frame_headers",
    "parse_int_header", "parse_int_list", "parse_position_ids", "parse_shape",
]
Encoding = Literal["identity", "zlib", "q8"]
FrameErrorCode = Literal[
    "bad_length", "unknown_dtype", "bad_shape", "too_large",
    "bad_chunk", "bad_encoding", "bad_header", "wire_version",
]

TORCH_DTYPES: Final[Mapping[DType, torch.dtype]] = MappingProxyType({
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
})
"""Wire dtype name -> torch dtype."""
DTYPE_NAMES: Final[Mapping[torch.dtype, DType]] = MappingProxyType(
    {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()}
)
"""Torch dtype -> wire dtype name."""
ITEMSIZE: Final[Mapping[DType, int]] = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2})
"""Bytes per element of each wire dtype."""

ZLIB_LEVEL: Final = 1
"""zlib level used when sending: activations barely compress, so favour speed."""

_UNSIGNED = re.compile(r"[0-9]{1,12}")
_SIGNED = re.compile(r"-?[0-9]{1,12}")
_SESSION = re.compile(r"[A-Za-z0-9._:\-]+")
_FRAME_HEADERS: Final = frozenset(
    name.lower() for name in (h.WIRE, h.SHAPE, h.DTYPE, h.SESSION, h.CHUNK_INDEX, h.CHUNK_TOTAL, h.ENCODING)
)


class FrameError(ValueError):
    """A frame was refused. ``code`` is a short machine code; ``str()`` the human message."""

    def __init__(self, code: FrameErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: FrameErrorCode = code


@dataclass(frozen=True)
class FrameLimits:
    """What a receiver accepts. Every frame is bounded in rank, dims, bytes and chunks."""

    max_rank: int = limits.FRAME_MAX_RANK
    max_dim: int = limits.FRAME_MAX_DIM
    max_bytes: int = limits.FRAME_MAX_BYTES
    """Body bytes after decompression."""
    max_chunks: int = limits.FRAME_MAX_CHUNKS


@dataclass(frozen=True)
class FrameSpec:
    """What a frame's headers announce, validated: enough to read its body."""

    dtype: DType
    shape: tuple[int, ...]
    session: str
    chunk_index: int
    chunk_total: int
    encoding: Encoding

    @property
    def nbytes(self) -> int:
        """Size of the decoded body: prod(shape) x itemsize."""
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Frame:
    """A decoded frame: the tensor (CPU, its wire dtype and shape) and its headers."""

    tensor: torch.Tensor
    session: str
    chunk_index: int
    chunk_total: int
    headers: Mapping[str, str] = field(default_factory=dict)
    """Every ``X-Meshnet-*`` header as received, keys lower-cased."""

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), or ``None``."""
        return self.headers.get(name.lower())


# --- header helpers -----------------------------------------------------------


def lower_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The ``X-Meshnet-*`` headers of ``headers`` with lower-cased keys."""
    prefix = h.PREFIX.lower()
    return {key.lower(): value for key, value in headers.items() if key.lower().startswith(prefix)}


def get_header(headers: Mapping[str, str], name: str) -> str | None:
    """Case-insensitive header lookup on any mapping (plain dicts included)."""
    value = headers.get(name)
    if value is not None:
        return value
    wanted = name.lower()
    for key, candidate in headers.items():
        if key.lower() == wanted:
            return candidate
    return None


def _bounded(name: str, value: str) -> str:
    if len(value) > limits.MAX_HEADER_VALUE_CHARS:
        raise FrameError("bad_header", f"{name} is longer than {limits.MAX_HEADER_VALUE_CHARS} characters")
    return value


def parse_int_header(name: str, value: str | None, *, default: int | None = None,
                     minimum: int | None = None, maximum: int | None = None) -> int:
    """Parse a decimal integer header strictly (ASCII digits only), within bounds.

    A missing header yields ``default``, or a ``bad_header`` refusal when there is none.
    """
    if value is None:
        if default is None:
            raise FrameError("bad_header", f"missing header {name}")
        return default
    text = _bounded(name, value).strip()
    if not _SIGNED.fullmatch(text):
        raise FrameError("bad_header", f"{name} must be an integer, got {text[:40]!r}")
    number = int(text)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise FrameError("bad_header", f"{name} must be within [{minimum}, {maximum}], got {number}")
    return number


def format_shape(shape: Iterable[int]) -> str:
    """``(1, 7, 576)`` -> ``"1,7,576"``."""
    return ",".join(str(int(dim)) for dim in shape)


def parse_shape(value: str | None, limits_: FrameLimits | None = None) -> tuple[int, ...]:
    """Parse ``"1,7,576"``, refusing (``bad_shape``) anything empty, malformed or out of limits."""
    lim = limits_ or FrameLimits()
    if value is None or not value.strip():
        raise FrameError("bad_shape", f"missing or empty {h.SHAPE}")
    parts = _bounded(h.SHAPE, value).split(",")
    if len(parts) > lim.max_rank:
        raise FrameError("bad_shape", f"shape has rank {len(parts)}, more than {lim.max_rank}")
    shape: list[int] = []
    for part in parts:
        text = part.strip()
        if not _UNSIGNED.fullmatch(text):
            raise FrameError("bad_shape", f"shape {value[:80]!r} is not comma-separated positive integers")
        dim = int(text)
        if not 1 <= dim <= lim.max_dim:
            raise FrameError("bad_shape", f"shape dimension {dim} is outside [1, {lim.max_dim}]")
        shape.append(dim)
    return tuple(shape)


def format_int_list(values: Iterable[int]) -> str:
    """``[0, 1, 2]`` -> ``"0,1,2"`` (the ``Position-Ids`` / ``Attn-Mask`` format)."""
    return ",".join(str(int(v)) for v in values)


def parse_int_list(name: str, value: str, max_items: int = limits.MAX_POSITION_LIST) -> tuple[int, ...]:
    """Parse a comma-separated integer list header, refusing (``bad_header``) malformed input."""
    text = value.strip()
    if not text:
        return ()
    if len(text) > max_items * 13:
        raise FrameError("bad_header", f"{name} lists more than {max_items} values")
    parts = text.split(",")
    if len(parts) > max_items:
        raise FrameError("bad_header", f"{name} lists more than {max_items} values")
    out: list[int] = []
    for part in parts:
        item = part.strip()
        if not _SIGNED.fullmatch(item):
            raise FrameError("bad_header", f"{name} must be comma-separated integers, got {item[:40]!r}")
        out.append(int(item))
    return tuple(out)


def format_position_ids(positions: Iterable[int]) -> str:
    """Format ``X-Meshnet-Position-Ids``: comma-separated non-negative ints."""
    return format_int_list(positions)


def parse_position_ids(value: str) -> tuple[int, ...]:
    """Parse ``X-Meshnet-Position-Ids``; every position must be >= 0."""
    positions = parse_int_list(h.POSITION_IDS, value)
    if any(p < 0 for p in positions):
        raise FrameError("bad_header", f"{h.POSITION_IDS} must not contain negative positions")
    return positions


def format_attn_mask(mask: Iterable[int]) -> str:
    """Format ``X-Meshnet-Attn-Mask``: comma-separated 0/1 values."""
    return format_int_list(mask)


def parse_attn_mask(value: str) -> tuple[int, ...]:
    """Parse ``X-Meshnet-Attn-Mask``; every value must be 0 or 1."""
    mask = parse_int_list(h.ATTN_MASK, value)
    if any(v not in (0, 1) for v in mask):
        raise FrameError("bad_header", f"{h.ATTN_MASK} must contain only 0 and 1")
    return mask


# --- validation -----------------------------------------------------------------


def check_session_id(session: str | None) -> str:
    """A session id as frames allow it (1-128 of ``[A-Za-z0-9._:-]``), or :class:`FrameError` ``bad_header``."""
    if not session:
        raise FrameError("bad_header", f"missing header {h.SESSION}")
    if len(session) > limits.MAX_SESSION_ID_CHARS or not _SESSION.fullmatch(session):
        raise FrameError(
            "bad_header",
            f"{h.SESSION} must be 1-{limits.MAX_SESSION_ID_CHARS} characters of [A-Za-z0-9._:-]",
        )
    return session


def _check_chunks(index: int, total: int, lim: FrameLimits) -> None:
    if not 0 < total <= lim.max_chunks or not 0 <= index < total:
        raise FrameError(
            "bad_chunk",
            f"chunk index/total {index}/{total} must satisfy 0 <= index < total <= {lim.max_chunks}",
        )


def _parse_chunk(name: str, value: str | None) -> int:
    if value is None:
        raise FrameError("bad_chunk", f"missing header {name}")
    text = _bounded(name, value).strip()
    if not _SIGNED.fullmatch(text):
        raise FrameError("bad_chunk", f"{name} must be an integer, got {text[:40]!r}")
    return int(text)


def compress_bound(nbytes: int) -> int:
    """The most bytes zlib can produce from ``nbytes`` of input (zlib's ``compressBound``)."""
    return nbytes + (nbytes >> 12) + (nbytes >> 14) + (nbytes >> 25) + 13


def parse_frame_headers(headers: Mapping[str, str], limits_: FrameLimits | None = None) -> FrameSpec:
    """Validate a frame's headers (case-insensitive) and say how to read its body."""
    lim = limits_ or FrameLimits()
    wire = get_header(headers, h.WIRE)
    if wire is None or wire.strip() not in h.WIRE_VERSIONS:
        raise FrameError(
            "wire_version", f"{h.WIRE} must be one of {sorted(h.WIRE_VERSIONS)}, "
                            f"got {None if wire is None else wire[:20]!r}"
        )
    dtype = (get_header(headers, h.DTYPE) or "").strip()
    if dtype not in TORCH_DTYPES:
        raise FrameError("unknown_dtype", f"dtype {dtype[:40]!r} is not one of {', '.join(TORCH_DTYPES)}")
    shape = parse_shape(get_header(headers, h.SHAPE), lim)
    session = check_session_id(get_header(headers, h.SESSION))
    index = _parse_chunk(h.CHUNK_INDEX, get_header(headers, h.CHUNK_INDEX))
    total = _parse_chunk(h.CHUNK_TOTAL, get_header(headers, h.CHUNK_TOTAL))
    _check_chunks(index, total, lim)
    encoding = (get_header(headers, h.ENCODING) or "identity").strip().lower()
    if encoding not in get_args(Encoding):
        raise FrameError("bad_encoding", f"encoding {encoding[:40]!r} is not one of {', '.join(get_args(Encoding))}")
    spec = FrameSpec(dtype, shape, session, index, total, encoding)  # type: ignore[arg-type]
    if spec.nbytes > lim.max_bytes:
        raise FrameError("too_large", f"frame of shape {shape} {dtype} is {spec.nbytes} bytes, over {lim.max_bytes}")
    return spec


def body_bound(spec: FrameSpec) -> int:
    """The most bytes the body of a frame announced by ``spec`` may be."""
    if spec.encoding == "identity":
        return spec.nbytes
    if spec.encoding == "q8":
        return q8.q8_nbytes(math.prod(spec.shape))
    return compress_bound(spec.nbytes)


def _check_body_length(spec: FrameSpec, length: int) -> None:
    if spec.encoding == "q8":
        if length != body_bound(spec):
            raise FrameError("bad_length", f"q8 body is {length} bytes, shape {spec.shape} needs {body_bound(spec)}")
    elif spec.encoding == "identity":
        if length != spec.nbytes:
            raise FrameError(
                "bad_length",
                f"body is {length} bytes, shape {spec.shape} {spec.dtype} needs {spec.nbytes}",
            )
    elif length > compress_bound(spec.nbytes):
        raise FrameError("too_large", f"compressed body of {length} bytes is larger than its content can be")


def check_frame_headers(headers: Mapping[str, str], content_length: int | None,
                        limits: FrameLimits = FrameLimits()) -> None:
    """Refuse a bad frame from its headers alone, before its body is read.

    ``content_length`` is the request's Content-Length, or ``None`` when the
    sender did not give one (then only :func:`decode_frame` can check it).
    """
    spec = parse_frame_headers(headers, limits)
    if content_length is not None:
        _check_body_length(spec, content_length)


# --- byte conversion ------------------------------------------------------------


def _to_wire_bytes(tensor: torch.Tensor) -> bytes:
    itemsize = tensor.element_size()
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder != "little":
        raw = raw.reshape(-1, itemsize).flip(1).reshape(-1)
    return raw.numpy().tobytes()


def wire_bytes(tensor: torch.Tensor) -> bytes:
    """``tensor``'s bytes as an ``identity`` frame carries them (little-endian, its own dtype)."""
    return _to_wire_bytes(tensor)


def _from_wire_bytes(body: bytes | bytearray, spec: FrameSpec) -> torch.Tensor:
    # bytes are read-only and copied; a bytearray is handed over: the tensor is a view of it, not a copy
    # (a KV pull's chunk is tens of megabytes)
    raw = torch.frombuffer(body if isinstance(body, bytearray) else bytearray(body), dtype=torch.uint8)
    if sys.byteorder != "little":
        raw = raw.reshape(-1, ITEMSIZE[spec.dtype]).flip(1).reshape(-1).contiguous()
    return raw.view(TORCH_DTYPES[spec.dtype]).reshape(spec.shape)


def _inflate(body: bytes, expected: int) -> bytes:
    """Decompress at most ``expected + 1`` bytes: enough to tell a right size from a wrong one."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(body, expected + 1)
    except zlib.error as exc:
        raise FrameError("bad_encoding", f"body does not decompress as zlib: {exc}") from None
    if len(out) > expected or inflater.unconsumed_tail:
        raise FrameError("bad_length", f"body decompresses to more than the {expected} bytes its shape needs")
    if not inflater.eof:
        raise FrameError("bad_encoding", "zlib body is truncated")
    if inflater.unused_data:
        raise FrameError("bad_encoding", "zlib body has trailing bytes")
    if len(out) != expected:
        raise FrameError("bad_length", f"body decompresses to {len(out)} bytes, its shape needs {expected}")
    return out


# --- public API -------------------------------------------------------------------


def encode_frame(tensor: torch.Tensor, *, session: str, chunk_index: int = 0, chunk_total: int = 1,
                 encoding: Encoding = "identity", wire_version: str = h.WIRE_VERSION,
                 extra: Mapping[str, str] = MappingProxyType({})) -> tuple[dict[str, str], bytes]:
    """Encode ``tensor`` as a frame: ``(headers, body)``.

    ``extra`` adds headers (hop index, route, step...); it may not override
    the frame's own headers. ``identity`` encoding sends no ``Encoding``
    header, as the reference did. ``q8`` is lossy (:mod:`meshwire.q8`): the
    frame announces the tensor's dtype, which the receiver decodes it to.
    """
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise FrameError("unknown_dtype", f"cannot send a {tensor.dtype} tensor; use one of {', '.join(TORCH_DTYPES)}")
    if tensor.dim() == 0 or any(dim < 1 for dim in tensor.shape):
        raise FrameError("bad_shape", f"cannot send a tensor of shape {tuple(tensor.shape)}")
    if encoding not in get_args(Encoding):
        raise FrameError("bad_encoding", f"unknown encoding {encoding!r}")
    check_session_id(session)
    _check_chunks(chunk_index, chunk_total, FrameLimits(max_chunks=max(chunk_total, 1)))
    clash = _FRAME_HEADERS.intersection(key.lower() for key in extra)
    if clash:
        raise ValueError(f"extra headers may not override frame headers: {sorted(clash)}")
    body = q8.quantize(tensor) if encoding == "q8" else _to_wire_bytes(tensor)
    out = {
        h.WIRE: wire_version,
        h.SHAPE: format_shape(tensor.shape),
        h.DTYPE: dtype,
        h.SESSION: session,
        h.CHUNK_INDEX: str(chunk_index),
        h.CHUNK_TOTAL: str(chunk_total),
    }
    if encoding == "zlib":
        body = zlib.compress(body, ZLIB_LEVEL)
    if encoding != "identity":
        out[h.ENCODING] = encoding
    out.update(extra)
    return out, body


def decode_frame(headers: Mapping[str, str], body: bytes | bytearray,
                 limits: FrameLimits = FrameLimits()) -> Frame:
    """Decode a received frame, refusing with :class:`FrameError` anything that does not add up.

    A ``bytearray`` body is handed over (the frame's tensor is a view of it, not a copy): the caller must
    not change it afterwards."""
    return decode_frame_body(parse_frame_headers(headers, limits), headers, body)


def decode_frame_body(spec: FrameSpec, headers: Mapping[str, str], body: bytes | bytearray) -> Frame:
    """Decode the body of a frame whose headers :func:`parse_frame_headers` already read into ``spec``."""
    _check_body_length(spec, len(body))
    if spec.encoding == "q8":
        tensor = q8.dequantize(body, spec.shape, TORCH_DTYPES[spec.dtype])
    else:
        tensor = _from_wire_bytes(_inflate(body, spec.nbytes) if spec.encoding == "zlib" else body, spec)
    return Frame(
        tensor=tensor,
        session=spec.session,
        chunk_index=spec.chunk_index,
        chunk_total=spec.chunk_total,
        headers=MappingProxyType(lower_headers(headers)),
    )
