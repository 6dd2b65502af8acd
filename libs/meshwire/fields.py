"""Bounded field types shared by meshwire's pydantic models.

Each is an ``Annotated`` type so a schema says what a value may be in one
word (``NodeId``, ``HttpEndpoint``) and every bound lives in :mod:`meshwire.limits`.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import BeforeValidator, ConfigDict, Field

from meshwire import limits

STRICT_MODEL: Final = ConfigDict(frozen=True, strict=True, extra="forbid")
"""The default model config: immutable, no type coercion, unknown keys refused."""



def _as_tuple(value: Any) -> Any:
    """Accept a list where a tuple is declared: JSON has only arrays, Python callers pass lists."""
    return tuple(value) if isinstance(value, list) else value


AsTuple: Final = BeforeValidator(_as_tuple)
"""Put in ``Annotated[tuple[...], AsTuple]`` so strict models take lists for their tuple fields."""

def _api_keys(value: Any) -> Any:
    """Accept ``"k1,k2"`` (the environment form) as well as a sequence; empty entries are dropped."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",")]
    if isinstance(value, list | tuple):
        keys = tuple(key for key in value if isinstance(key, str) and key)
        if len(keys) > limits.MAX_API_KEYS:
            raise ValueError(f"at most {limits.MAX_API_KEYS} API keys")
        return keys
    return value


ApiKeyList: Final = BeforeValidator(_api_keys)
"""Put in ``Annotated[tuple[str, ...], ApiKeyList]``: client API keys, comma-separated in the environment."""

DType = Literal["float32", "bfloat16", "float16"]
"""Activation dtypes on the wire (declared here so torch-free code can name them)."""

NodeId = Annotated[str, Field(min_length=1, max_length=limits.MAX_ID_CHARS, pattern=r"^[A-Za-z0-9._:\-]+$")]
"""A node's id: letters, digits and ``._:-``."""

ModelName = Annotated[str, Field(min_length=1, max_length=limits.MAX_URL_CHARS, pattern=r"^[^\x00-\x1f\x7f]+$")]
"""A model name: a hub name or a local folder path; no control characters."""

HttpEndpoint = Annotated[str, Field(min_length=8, max_length=limits.MAX_URL_CHARS,
                                    pattern=r"^https?://[^\s\x00-\x1f\x7f]+$")]
"""Base URL of an HTTP service, e.g. ``http://10.0.0.5:8001``."""

WsAddress = Annotated[str, Field(min_length=6, max_length=limits.MAX_URL_CHARS,
                                 pattern=r"^wss?://[^\s\x00-\x1f\x7f]+$")]
"""A WebSocket URL, e.g. ``ws://relay:8003/rpc/node-a``."""

LayerIndex = Annotated[int, Field(ge=0, lt=limits.MAX_LAYERS)]
"""A 0-based decoder layer index."""

LayerCount = Annotated[int, Field(ge=1, le=limits.MAX_LAYERS)]
"""How many decoder layers a model has."""
