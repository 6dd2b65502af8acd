"""Several frames in one request: ``POST /forward/rows``, the batched hop.

When a node's step engine runs the decode steps of many sessions as one
batch, their results leave together, and most go to the same next hop. One
request carrying all of them replaces one request per session: the next hop
parses one body, answers once, and, since the rows reach its step engine in
the same moment, runs them as one batch of its own. Along a route of N nodes
a batch of B sessions costs N requests per token instead of N x B.

Each row is a complete single frame, exactly what ``POST /forward`` takes
(its ``X-Meshnet-*`` headers, its body), so every check a frame gets, it gets
here too, row by row, and one bad row is refused alone. The request body is::

    u32 big-endian index length | index JSON | row bodies, concatenated

with the index ``{"rows": [{"headers": {...}, "length": n}, ...]}`` in row
order. The answer is JSON ``{"rows": [{"status", "body", "retry_after"}]}``:
for each row, the status and JSON body ``POST /forward`` would have answered
for it alone. The request as a whole is authenticated once (the mesh's
bearer, before anything is read), and bounded: at most :data:`MAX_ROWS`
rows, an index of at most :data:`MAX_INDEX_BYTES`, a body within the node's
frame limit.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import orjson
from pydantic import BaseModel, Field, ValidationError

from meshwire import limits
from meshwire.fields import STRICT_MODEL
from meshwire.frames import FrameError

ROWS_PATH: Final = "/forward/rows"
"""Where a batch of frames is posted (beside ``/forward``, which takes one)."""
CONTENT_TYPE: Final = "application/x-meshnet-rows"
MAX_ROWS: Final = 256
"""Most frames one batch carries (a node's ``max_batch`` is at most this)."""
MAX_INDEX_BYTES: Final = 8 * limits.MIB
"""Largest index JSON: every row's headers (a route token is the biggest, at most 16 KiB)."""
MAX_ROW_HEADERS: Final = 32
"""Most headers one row carries."""
MAX_ANSWER_BYTES_PER_ROW: Final = 64 * limits.KIB
"""Largest answer body of one row (answers are small JSON)."""
_LENGTH: Final = struct.Struct(">I")


class _RowEntry(BaseModel):
    model_config = STRICT_MODEL

    headers: Annotated[dict[str, Annotated[str, Field(max_length=limits.MAX_HEADER_VALUE_CHARS)]],
                       Field(max_length=MAX_ROW_HEADERS)]
    length: Annotated[int, Field(ge=0, le=limits.FRAME_MAX_BYTES)]


class _RowIndex(BaseModel):
    model_config = STRICT_MODEL

    rows: Annotated[tuple[_RowEntry, ...], Field(min_length=1, max_length=MAX_ROWS)]


class RowAnswer(BaseModel):
    """What ``POST /forward`` would have answered one row: status, JSON body, ``Retry-After``."""

    model_config = STRICT_MODEL

    status: Annotated[int, Field(ge=100, le=599)]
    body: dict[str, Any]
    retry_after: Annotated[str, Field(max_length=32)] | None = None


class _Answers(BaseModel):
    model_config = STRICT_MODEL

    rows: Annotated[tuple[RowAnswer, ...], Field(max_length=MAX_ROWS)]


@dataclass(frozen=True)
class RowFrame:
    """One frame of a batch: its headers and its body, as ``POST /forward`` would receive them."""

    headers: Mapping[str, str]
    body: bytes


def encode_rows(rows: Sequence[tuple[Mapping[str, str], bytes]]) -> bytes:
    """The body of a ``POST /forward/rows`` carrying ``rows`` (each a frame's headers and body)."""
    if not 1 <= len(rows) <= MAX_ROWS:
        raise ValueError(f"a batch carries 1-{MAX_ROWS} frames, not {len(rows)}")
    index = orjson.dumps({"rows": [{"headers": dict(headers), "length": len(body)} for headers, body in rows]})
    return b"".join([_LENGTH.pack(len(index)), index, *(body for _, body in rows)])


def decode_rows(body: bytes) -> list[RowFrame]:
    """The frames of a batch body; :class:`FrameError` (``bad_header`` / ``bad_length``) when it does not add up."""
    if len(body) < _LENGTH.size:
        raise FrameError("bad_length", "a batch of frames starts with the 4-byte length of its index")
    (index_length,) = _LENGTH.unpack_from(body)
    if index_length > MAX_INDEX_BYTES or _LENGTH.size + index_length > len(body):
        raise FrameError("bad_length", f"the batch's index is {index_length} bytes: over {MAX_INDEX_BYTES} "
                                       "or past the end of the body")
    try:
        index = _RowIndex.model_validate_json(body[_LENGTH.size:_LENGTH.size + index_length])
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise FrameError("bad_header", f"the batch's index is not valid: {where}: {error['msg']}") from None
    offset = _LENGTH.size + index_length
    if offset + sum(entry.length for entry in index.rows) != len(body):
        raise FrameError("bad_length", "the batch's row lengths do not add up to its body")
    frames = []
    for entry in index.rows:
        frames.append(RowFrame(headers=entry.headers, body=body[offset:offset + entry.length]))
        offset += entry.length
    return frames


def encode_answers(answers: Sequence[RowAnswer]) -> bytes:
    """The JSON answer to a batch: one entry per row, in row order."""
    return orjson.dumps({"rows": [answer.model_dump() for answer in answers]})


def decode_answers(raw: bytes, rows: int) -> list[RowAnswer]:
    """The per-row answers of a batch of ``rows`` frames; ``ValueError`` when they are not that."""
    try:
        answers = _Answers.model_validate_json(raw)
    except ValidationError as exc:
        raise ValueError(f"not a batch answer: {exc.errors()[0]['msg']}") from None
    if len(answers.rows) != rows:
        raise ValueError(f"the batch answer has {len(answers.rows)} rows for {rows} frames")
    return list(answers.rows)
