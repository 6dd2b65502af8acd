"""How the tail picks each token of one session: the ``X-Meshnet-Sampling`` JSON.

The head writes it, every hop passes it on unread, and the tail parses it once
to build the session's sampler. It lives in ``meshwire`` because both ends of
``POST /forward`` must agree on it (the head's writer and the tail's reader).
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, Field, field_validator

from meshwire.fields import STRICT_MODEL
from meshwire.limits import MAX_TOP_K, MIN_TEMPERATURE

MAX_TEMPERATURE: Final = 100.0
"""Highest temperature accepted (OpenAI allows 2; extra room costs nothing)."""
MAX_SEED: Final = (1 << 63) - 1
"""Largest seed (torch seeds are 64-bit; keep to the signed range JSON tools handle)."""


class SamplingParams(BaseModel):
    """How the tail picks each token of one session (the ``X-Meshnet-Sampling`` JSON)."""

    model_config = STRICT_MODEL

    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    """0 is greedy; otherwise logits are divided by it before top-k/top-p."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass to keep; 1 is off."""
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    """Keep the k most likely tokens; 0 is off (OpenAI has no top_k)."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    """Seed of the session's generator."""

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {value!r}")
        return value

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax and no random draw is made."""
        return self.temperature == 0.0
