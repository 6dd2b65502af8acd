"""``tools`` and ``tool_choice``: the functions a model may call, and whether (or which) it must.

Tools are served only where the model's chat template renders them; a call's
arguments follow its function's ``parameters`` schema, which is bounded like a
``response_format`` schema (:mod:`meshwire.openai.formats`).
"""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, Field, field_validator

from meshwire.fields import STRICT_MODEL
from meshwire.openai.formats import MAX_SCHEMA_CHARS, SCHEMA_NAME_PATTERN, compact_chars

MAX_TOOLS: Final = 128
"""Most tools one request may declare (OpenAI's bound)."""


class FunctionSpec(BaseModel):
    """A function a model may call: its name, what it does, its arguments' JSON schema."""

    model_config = STRICT_MODEL

    name: str = Field(pattern=SCHEMA_NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_SCHEMA_CHARS)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and compact_chars(value) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the parameters schema is longer than {MAX_SCHEMA_CHARS} characters as compact JSON")
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("must be the JSON schema of an object (a call's arguments are a JSON object)")
        return value


class ToolSpec(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = STRICT_MODEL

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = STRICT_MODEL

    name: str = Field(pattern=SCHEMA_NAME_PATTERN)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the function the model must call."""

    model_config = STRICT_MODEL

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
