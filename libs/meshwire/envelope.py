"""The relay's message formats: the reference JSON envelope and the binary mux codec.

JSON envelope (reference form, one text WebSocket message each way, used on
``ws://relay/rpc/{peer_id}``)::

    request  {"request_id", "method", "path", "headers", "body_base64"}
    response {"request_id"?, "status", "headers", "body_base64"}

Binary mux (``ws://relay/mux/{peer_id}``): one binary WebSocket message is
``u32 big-endian header_len | header JSON (an object) | body``, so a frame body
travels without base64's third more bytes and many requests can share one
socket (the header carries their ids).

Every size is bounded; a message that does not parse, and an envelope that
cannot be built (an answer whose header is over
:data:`meshwire.limits.MAX_HEADER_VALUE_CHARS`, say), raises
:class:`EnvelopeError`, never anything else: the relay turns it into an error
answer for that one request and goes on serving.
"""

from __future__ import annotations

import base64
import binascii
import struct
from typing import Annotated, Any, Final, Literal

import orjson
from pydantic import AfterValidator, BaseModel, Field, ValidationError

from meshwire import limits
from meshwire.fields import STRICT_MODEL

HttpMethod = Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
EnvelopeErrorCode = Literal["too_large", "truncated", "bad_header", "bad_envelope"]

MUX_PREFIX: Final = struct.Struct(">I")
"""The mux message's header-length prefix: u32, big-endian."""
MAX_BODY_BASE64_CHARS: Final = 4 * ((limits.RELAY_MAX_BODY_BYTES + 2) // 3)
MAX_HEADER_NAME_CHARS: Final = 256
MAX_REQUEST_ID_CHARS: Final = 128



class EnvelopeError(ValueError):
    """A relay message was refused; ``code`` says why, ``str()`` says it in words."""

    def __init__(self, code: EnvelopeErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: EnvelopeErrorCode = code


def _check_headers(headers: dict[str, str]) -> dict[str, str]:
    """Every header name and value within its bound; the error names the header and the bound."""
    for name, value in headers.items():
        if not name or len(name) > MAX_HEADER_NAME_CHARS:
            raise ValueError(f"header name {name[:40]!r} is empty or over {MAX_HEADER_NAME_CHARS} characters")
        if len(value) > limits.MAX_HEADER_VALUE_CHARS:
            raise ValueError(f"header {name[:40]!r} has a value of {len(value)} characters, over "
                             f"{limits.MAX_HEADER_VALUE_CHARS}")
    return headers


HeaderMap = Annotated[dict[str, str], Field(max_length=limits.RELAY_MAX_HEADERS), AfterValidator(_check_headers)]
"""HTTP headers carried through the relay, in either form: at most
:data:`meshwire.limits.RELAY_MAX_HEADERS` of them, each name and value bounded."""


def validation_problem(exc: ValidationError, what: str) -> str:
    """The first problem of ``exc`` in words, with where it is (``invalid relay envelope at headers: ...``)."""
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "top level"
    return f"invalid {what} at {where}: {first['msg']}"


def _b64decode(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise EnvelopeError("bad_envelope", "body_base64 is not valid base64") from None


class RelayRequest(BaseModel):
    """An HTTP request carried to a peer through the relay."""

    model_config = STRICT_MODEL

    request_id: str = Field(min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    method: HttpMethod
    path: str = Field(min_length=1, max_length=limits.RELAY_MAX_PATH_CHARS, pattern=r"^/[^\s\x00-\x1f\x7f]*$")
    headers: HeaderMap = Field(default_factory=dict)
    body_base64: str = Field(default="", max_length=MAX_BODY_BASE64_CHARS)

    @classmethod
    def of(cls, request_id: str, method: HttpMethod, path: str, headers: dict[str, str], body: bytes) -> RelayRequest:
        """Build a request envelope around raw ``body`` bytes; :class:`EnvelopeError` when it breaks a bound."""
        try:
            return cls(request_id=request_id, method=method, path=path, headers=dict(headers),
                       body_base64=base64.b64encode(body).decode("ascii"))
        except ValidationError as exc:
            raise EnvelopeError("bad_envelope", validation_problem(exc, "relay request")) from None

    def body(self) -> bytes:
        """The decoded body (raises :class:`EnvelopeError` on bad base64)."""
        return _b64decode(self.body_base64)


class RelayResponse(BaseModel):
    """A peer's answer to a :class:`RelayRequest` (or the relay's own, e.g. 502 peer gone).

    ``body`` is the reference's plain-text fallback, read when ``body_base64`` is empty.
    """

    model_config = STRICT_MODEL

    request_id: str | None = Field(default=None, max_length=MAX_REQUEST_ID_CHARS)
    status: int = Field(ge=100, le=599)
    headers: HeaderMap = Field(default_factory=dict)
    body_base64: str = Field(default="", max_length=MAX_BODY_BASE64_CHARS)
    body: str | None = Field(default=None, max_length=limits.RELAY_MAX_BODY_BYTES)

    @classmethod
    def of(cls, status: int, headers: dict[str, str], body: bytes, request_id: str | None = None) -> RelayResponse:
        """Build a response envelope around raw ``body`` bytes.

        Raises :class:`EnvelopeError` (``bad_envelope``, naming the field) when the
        answer breaks a bound, e.g. a header value over
        :data:`meshwire.limits.MAX_HEADER_VALUE_CHARS`: the relay answers that
        request with an error instead of leaving it unanswered.
        """
        try:
            return cls(request_id=request_id, status=status, headers=dict(headers),
                       body_base64=base64.b64encode(body).decode("ascii"))
        except ValidationError as exc:
            raise EnvelopeError("bad_envelope", validation_problem(exc, "relay response")) from None

    def body_bytes(self) -> bytes:
        """The decoded body: ``body_base64``, else the text ``body``, else empty."""
        if self.body_base64:
            return _b64decode(self.body_base64)
        return (self.body or "").encode("utf-8")


def _decode_json_envelope(model: type[BaseModel], raw: str | bytes, max_bytes: int) -> Any:
    if len(raw) > max_bytes:
        raise EnvelopeError("too_large", f"relay message of {len(raw)} bytes is over {max_bytes}")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise EnvelopeError("bad_envelope", validation_problem(exc, "relay envelope")) from None


def decode_request(raw: str | bytes, max_bytes: int = limits.RELAY_MAX_MESSAGE_BYTES) -> RelayRequest:
    """Parse a JSON request envelope, bounded by ``max_bytes``."""
    return _decode_json_envelope(RelayRequest, raw, max_bytes)


def decode_response(raw: str | bytes, max_bytes: int = limits.RELAY_MAX_MESSAGE_BYTES) -> RelayResponse:
    """Parse a JSON response envelope, bounded by ``max_bytes``."""
    return _decode_json_envelope(RelayResponse, raw, max_bytes)


def encode_mux(header: dict[str, Any], body: bytes) -> bytes:
    """Encode one binary mux message: ``u32 be header_len | header JSON | body``."""
    try:
        header_json = orjson.dumps(header)
    except orjson.JSONEncodeError as exc:
        raise EnvelopeError("bad_header", f"mux header is not JSON-serialisable: {exc}") from None
    if len(header_json) > limits.RELAY_MAX_HEADER_JSON_BYTES:
        raise EnvelopeError("too_large", f"mux header of {len(header_json)} bytes is over "
                                         f"{limits.RELAY_MAX_HEADER_JSON_BYTES}")
    return MUX_PREFIX.pack(len(header_json)) + header_json + body


def decode_mux(data: bytes, max_bytes: int = limits.RELAY_MAX_MESSAGE_BYTES) -> tuple[dict[str, Any], bytes]:
    """Decode one binary mux message into ``(header, body)``, refusing anything malformed."""
    if len(data) > max_bytes:
        raise EnvelopeError("too_large", f"mux message of {len(data)} bytes is over {max_bytes}")
    if len(data) < MUX_PREFIX.size:
        raise EnvelopeError("truncated", "mux message is shorter than its length prefix")
    (header_len,) = MUX_PREFIX.unpack_from(data)
    if header_len > limits.RELAY_MAX_HEADER_JSON_BYTES:
        raise EnvelopeError("too_large", f"mux header length {header_len} is over {limits.RELAY_MAX_HEADER_JSON_BYTES}")
    end = MUX_PREFIX.size + header_len
    if end > len(data):
        raise EnvelopeError("truncated", f"mux header length {header_len} runs past the message's end")
    try:
        header = orjson.loads(data[MUX_PREFIX.size:end])
    except orjson.JSONDecodeError:
        raise EnvelopeError("bad_header", "mux header is not valid JSON") from None
    if not isinstance(header, dict):
        raise EnvelopeError("bad_header", "mux header must be a JSON object")
    return header, bytes(data[end:])
