"""Continuing a stream whose head died: what the tracker learns as it relays, and what it sends on.

The head of a route holds a stream's history, so a dead head would end the
stream; the tracker, which relays every stream, keeps that history instead:

* **Progress.** The tracker asks the head (header ``X-Meshnet-Progress: 1``)
  to add to every stream event the ids of the tokens behind it, under
  :data:`PROGRESS_KEY`: ``{"ids": [...]}``, and ``"seed"`` (the sampler seed
  the head chose, so an unseeded sampled stream can go on identically) on the
  first event. The tracker strips the key before the client sees the event.
  An event's ids are the tokens whose text it carries (a token's text may be
  held back for an incomplete character or a possible stop string, so its id
  travels with the event that finally carries it).
* **Resume.** When the head stops answering mid-stream, the tracker sends the
  same request to the head of a route that avoids it, with
  :data:`RESUME_KEY` added to the body: ``{"ids": [every id relayed so far],
  "seed": seed}``. The new head replays those tokens (prefill of prompt plus
  ids, the sampler advanced by one draw per token, the text state rebuilt
  without emitting it) and streams only what follows; the tracker drops its
  opening event (the role) and gives its events the stream's first id.

Only the mesh may resume: a node reads :data:`RESUME_KEY` only from a request
carrying the mesh secret, and the tracker refuses a client body holding it
(unknown parameter).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import orjson
from pydantic import BaseModel, Field

from meshwire import limits
from meshwire.fields import STRICT_MODEL, AsTuple

PROGRESS_KEY: Final = "meshnet"
"""Key of the progress extension inside a stream event's JSON."""
RESUME_KEY: Final = "meshnet_resume"
"""Key of the resume extension inside a request body (from the tracker only)."""

TokenIds = Annotated[tuple[Annotated[int, Field(ge=0, lt=1 << 31)], ...], AsTuple,
                     Field(max_length=limits.MAX_TOKENS_LIMIT)]


class Progress(BaseModel):
    """What one stream event adds to the stream's history."""

    model_config = STRICT_MODEL

    ids: TokenIds = ()
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)


class Resume(BaseModel):
    """The history a new head continues from: the tokens relayed so far and the sampler seed."""

    model_config = STRICT_MODEL

    ids: TokenIds
    seed: int = Field(ge=0, lt=1 << 63)


def with_progress(event: dict[str, Any], progress: Progress) -> bytes:
    """``event`` (a stream chunk's JSON object) with ``progress`` added, as JSON bytes."""
    return orjson.dumps({**event, PROGRESS_KEY: progress.model_dump(exclude_none=True)})


def resume_body(body: bytes, resume: Resume) -> bytes:
    """The request ``body`` with ``resume`` added (what the tracker sends a new head)."""
    payload = orjson.loads(body)
    payload[RESUME_KEY] = resume.model_dump()
    return orjson.dumps(payload)


def take_resume(body: bytes) -> tuple[bytes, Resume | None]:
    """The request body without :data:`RESUME_KEY`, and the resume it held (``None``: a fresh request).

    Raises ``ValueError`` (pydantic's ``ValidationError`` or a JSON error) when it is malformed.
    """
    if RESUME_KEY.encode() not in body:
        return body, None
    payload = orjson.loads(body)
    if not isinstance(payload, dict) or RESUME_KEY not in payload:
        return body, None
    resume = Resume.model_validate(payload.pop(RESUME_KEY))
    return orjson.dumps(payload), resume
