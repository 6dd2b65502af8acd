"""How the tail picks each token of one session: the ``X-Meshnet-Sampling`` JSON.

The head writes it, every hop passes it on unread, and the tail parses it once
to build the session's sampler. It lives in ``meshwire`` because both ends of
``POST /forward`` must agree on it (the head's writer and the tail's reader).
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import BaseModel, Field, field_validator

from meshwire.fields import STRICT_MODEL, AsTuple
from meshwire.limits import MAX_TOP_K, MIN_TEMPERATURE

MAX_TEMPERATURE: Final = 100.0
"""Highest temperature accepted (OpenAI allows 2; extra room costs nothing)."""
MAX_SEED: Final = (1 << 63) - 1
"""Largest seed (torch seeds are 64-bit; keep to the signed range JSON tools handle)."""
MAX_LOGIT_BIAS_ENTRIES: Final = 300
"""Most tokens one request may bias (OpenAI's bound)."""
MAX_LOGIT_BIAS: Final = 100.0
"""Largest bias, either sign (OpenAI's range: -100 bans a token, 100 all but forces it)."""
MAX_TOP_LOGPROBS: Final = 20
"""Most alternatives per token whose log-probabilities a request may ask for (OpenAI's bound)."""

MAX_GRAMMAR_CHARS: Final = 12 * 1024
"""Longest grammar one session may carry: it travels in ``X-Meshnet-Sampling`` (at most
:data:`meshwire.limits.MAX_HEADER_VALUE_CHARS` with everything else), so it stays well under that."""
MAX_REPLAY_IDS_PER_FRAME: Final = 512
"""Most generated token ids one replayed frame carries to the tail in ``X-Meshnet-Sample-Ids``
(a head replaying a grammar-constrained session sends its frames at most this long)."""

LOGPROB_FLOOR: Final = -9999.0
"""The log-probability reported for a token with none (``-inf`` has no JSON form; OpenAI reports this)."""

TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]


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
    logit_bias: Annotated[tuple[Annotated[tuple[TokenId, Bias], AsTuple], ...], AsTuple,
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] = ()
    """``(token id, bias)`` pairs added to the model's logits before anything else (greedy included)."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """``None``: no log-probabilities; else the chosen token's and this many top alternatives' (0-20)."""
    grammar: str | None = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    """An llguidance grammar (the JSON the head compiled a ``response_format`` into) that every sampled
    token must follow: the tail masks the logits to the tokens it allows, after ``logit_bias`` and before
    everything else. The tail's grammar state is a function of the tokens generated so far, so a tail
    rebuilt by failover replays them into it (``X-Meshnet-Sample-Ids``)."""

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


class TokenLogprobs(BaseModel):
    """The tail's log-probabilities for one sampled token (when :attr:`SamplingParams.logprobs` is set).

    Computed from the same float32 logits the token was drawn from, after
    ``logit_bias`` and the grammar mask (a token the grammar forbids has
    :data:`LOGPROB_FLOOR`) and before temperature, top-k and top-p: the
    model's own distribution (as OpenAI and vLLM report it), not the warped one.
    """

    model_config = STRICT_MODEL

    logprob: float
    """The chosen token's log-probability (at least :data:`LOGPROB_FLOOR`)."""
    top: Annotated[tuple[Annotated[tuple[TokenId, float], AsTuple], ...], AsTuple,
                   Field(max_length=MAX_TOP_LOGPROBS)] = ()
    """The most likely tokens, most likely first: ``(token id, log-probability)``."""
