"""Which answers of a head node the tracker relays to a client, and in what form.

The tracker POSTs to a head's endpoint as the mesh (signed with its route key), so what
comes back must not become a way to read another service through the
tracker. Only two kinds of answer reach the client:

- a 2xx whose content type is JSON or server-sent events: the head's
  completion, streamed through as it arrives (:func:`relayable_success`);
- a 4xx or 5xx whose body is an OpenAI error, ``{"error": {"message": str,
  "type": str, "code"?, "param"?, ...}}``: rebuilt from the parsed error, with
  only the ``error`` object, its message cut to :data:`MAX_MESSAGE_CHARS` and
  its extra keys (``failed_node``...) kept only where they are plain scalars
  (:func:`parse_openai_error`).

Anything else (HTML, plain text, a redirect, JSON of another shape, an error
as an event stream) is answered as a 502 ``head_bad_answer`` that names the
head and its status but quotes nothing it said (:func:`bad_answer`).
"""

from __future__ import annotations

from typing import Final

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshwire import errors
from meshwire.sse import MEDIA_TYPE as SSE_MEDIA_TYPE

from .responses import HTTPError

JSON_MEDIA_TYPE: Final = "application/json"
RELAYABLE_SUCCESS_TYPES: Final = frozenset({JSON_MEDIA_TYPE, SSE_MEDIA_TYPE})
"""Content types of a 2xx head answer that are relayed."""
MAX_MESSAGE_CHARS: Final = 4096
"""Longest error message relayed from a head; longer ones are cut."""
MAX_FIELD_CHARS: Final = 256
"""Longest ``type``, ``code``, ``param`` or extra string relayed from a head."""
MAX_EXTRA_KEYS: Final = 16
"""Most extra keys of a head's error object relayed."""
ERROR_STATUSES: Final = range(400, 600)
"""Statuses whose OpenAI-shaped error bodies are relayed."""

STANDARD_KEYS: Final = frozenset({"message", "type", "code", "param"})

Scalar = str | int | float | bool | None


class _HeadError(BaseModel):
    """The ``error`` object of an OpenAI error, as a head must send it."""

    model_config = ConfigDict(frozen=True, strict=True, extra="allow")

    message: str
    type: str = Field(min_length=1, max_length=MAX_FIELD_CHARS)
    code: str | None = Field(default=None, max_length=MAX_FIELD_CHARS)
    param: str | None = Field(default=None, max_length=MAX_FIELD_CHARS)


class _HeadErrorBody(BaseModel):
    """An OpenAI error body: an ``error`` object (other top-level keys are dropped)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")

    error: _HeadError


def media_type(response: httpx.Response) -> str:
    """The response's content type without parameters, lower case."""
    return response.headers.get("content-type", "").split(";")[0].strip().lower()


def relayable_success(response: httpx.Response) -> bool:
    """Whether a head's 2xx answer may be streamed to the client as it is."""
    return response.is_success and media_type(response) in RELAYABLE_SUCCESS_TYPES


def parse_openai_error(raw: bytes) -> dict[str, Scalar] | None:
    """The ``error`` object of an OpenAI error body, bounded and flattened; ``None`` if ``raw`` is not one."""
    try:
        parsed = _HeadErrorBody.model_validate(orjson.loads(raw))
    except (orjson.JSONDecodeError, ValidationError):
        return None
    error = parsed.error
    out: dict[str, Scalar] = {"message": error.message[:MAX_MESSAGE_CHARS], "type": error.type,
                              "code": error.code, "param": error.param}
    for key, value in list((error.model_extra or {}).items())[:MAX_EXTRA_KEYS]:
        if len(key) <= MAX_FIELD_CHARS and (value is None or isinstance(value, (str, int, float, bool))):
            out[key] = value[:MAX_FIELD_CHARS] if isinstance(value, str) else value
    return out


def relayed_error(status: int, error: dict[str, Scalar], retry_after: str | None = None) -> HTTPError:
    """A head's well-formed OpenAI error, as the tracker answers it."""
    code, param = error.get("code"), error.get("param")
    headers = {"Retry-After": retry_after} if retry_after and retry_after.isdigit() else None
    relayed = HTTPError(status, str(error["message"]), str(error["type"]),
                        code if isinstance(code, str) else None, param if isinstance(param, str) else None,
                        headers=headers)
    # Extras go into the body directly: as keyword arguments a key named ``headers`` would collide.
    relayed.body["error"].update({k: v for k, v in error.items() if k not in STANDARD_KEYS})
    return relayed


def bad_answer(head_id: str, status: int, what: str) -> HTTPError:
    """The 502 a client gets for a head answer that is not relayable (``what`` says why, not what it said)."""
    return HTTPError(502, f"the head node {head_id} answered HTTP {status} with {what}, not an OpenAI answer",
                     errors.SERVER_ERROR, "head_bad_answer", failed_node=head_id)
