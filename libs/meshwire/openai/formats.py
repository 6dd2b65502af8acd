"""``response_format``: the shape every answer must take (free text, a JSON object, or JSON matching a schema).

The tail constrains each token to a grammar compiled from it; a schema the
engine cannot enforce is a 400. The schema's size is bounded because its
grammar travels to the tail in a header.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from meshwire.fields import STRICT_MODEL

MAX_SCHEMA_CHARS: Final = 8 * 1024
"""Longest ``response_format`` JSON schema (as compact JSON): its grammar travels to the tail in a header."""
SCHEMA_NAME_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
"""OpenAI's rule for ``json_schema.name``."""


def compact_chars(schema: dict[str, Any]) -> int:
    """The length of ``schema`` as compact JSON: what :data:`MAX_SCHEMA_CHARS` bounds."""
    return len(json.dumps(schema, separators=(",", ":")))


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``: the schema every answer must match.

    ``strict`` is accepted either way: the schema is always enforced as OpenAI's
    ``strict: true`` enforces it, and a schema the engine cannot enforce is a 400.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(pattern=SCHEMA_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_SCHEMA_CHARS)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("json_schema")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and compact_chars(value) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the schema is longer than {MAX_SCHEMA_CHARS} characters as compact JSON")
        return value


class TextFormat(BaseModel):
    """``{"type": "text"}``: free text (the default)."""

    model_config = STRICT_MODEL

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    """``{"type": "json_object"}``: the answer is one JSON object."""

    model_config = STRICT_MODEL

    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    """``{"type": "json_schema", "json_schema": {...}}``: the answer is JSON matching the schema."""

    model_config = STRICT_MODEL

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _format_type(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, Mapping) else getattr(value, "type", None)
    return f"[{kind}]" if kind in ("text", "json_object", "json_schema") else None


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("[text]")] | Annotated[JsonObjectFormat, Tag("[json_object]")]
    | Annotated[JsonSchemaFormat, Tag("[json_schema]")],
    Discriminator(_format_type, custom_error_type="invalid_response_format",
                  custom_error_message="type must be 'text', 'json_object' or 'json_schema'")]
"""``response_format``, chosen by its ``type`` (the tags are bracketed so an error's location skips them)."""
