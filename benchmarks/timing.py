"""What one streamed generation measured: when its tokens arrived.

The mesh (through the OpenAI stream) and single-process transformers (through
a streamer) are timed the same way, so their figures compare directly:

- time to first token: from sending the request to the first token;
- decode rate: tokens after the first, over the time between the first and
  the last token. Prefill is excluded; it is measured on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MIN_DECODE_TOKENS: Final = 2
"""A decode rate needs at least two tokens (one interval)."""


class TooFewTokens(RuntimeError):
    """The generation stopped before it produced enough tokens to time decoding."""


@dataclass(frozen=True)
class StreamTiming:
    """One generation: ``tokens`` produced, the first at ``first_s``, the last at ``last_s``.

    Times are seconds since the request was sent.
    """

    tokens: int
    first_s: float
    last_s: float
    prompt_tokens: int | None = None

    @property
    def ttft_s(self) -> float:
        """Time to first token (prefill, plus the network for the mesh)."""
        return self.first_s

    @property
    def decode_s(self) -> float:
        return self.last_s - self.first_s

    @property
    def ms_per_token(self) -> float:
        """Milliseconds a decoded token took, prefill excluded."""
        self._check()
        return 1000.0 * self.decode_s / (self.tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens a second, prefill excluded."""
        self._check()
        return (self.tokens - 1) / self.decode_s

    def _check(self) -> None:
        if self.tokens < MIN_DECODE_TOKENS or self.decode_s <= 0:
            raise TooFewTokens(f"{self.tokens} tokens in {self.decode_s * 1000:.1f} ms: too few to time decoding")
