"""What a generation takes and what it gives: the request, and the events of its answer.

A :class:`GenerationRequest` goes into :meth:`services.node.head.generation.Generator.generate`; a stream of
:class:`TextDelta` events comes out, then one :class:`Finished`. The API wing renders these (streamed or
collected); they carry nothing of the route or the session.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Literal

from meshwire.fork import ChoiceGroup
from meshwire.sampling_params import MAX_SEED, SamplingParams, TokenLogprobs
from services.node.pd.pd_head import PrefillPlan

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt ids, limits, stop strings and sampling (with a definite seed)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop: tuple[str, ...]
    sampling: SamplingParams
    echo: str | None = None
    """A completion's prompt text to give back before the answer (``echo``); with ``sampling.logprobs`` set,
    the tail also scores every prompt token."""
    resume: tuple[int, ...] = ()
    """Tokens of this answer already generated and relayed by a head that died (``meshwire.resume``):
    they are replayed, not sent again, and the answer goes on after them."""
    prefill: PrefillPlan | None = None
    """A prefill route to run the prompt along (a long prompt, on a mesh with prefill nodes)."""
    group: ChoiceGroup | None = None
    """The ``n > 1`` request this is one choice of (:mod:`meshwire.fork`): its prompt is prefilled once."""


    def prompt_scoring(self, generated: int) -> int | None:
        """Alternatives per prompt token the tail must score on a prefill after ``generated`` tokens (``None``:
        no scoring).

        Only a completion that echoes its prompt with log-probabilities asks, and only before its first token
        (a replay after it does not: the echo has been given)."""
        if self.echo is None or self.sampling.logprobs is None or generated:
            return None
        return self.sampling.logprobs


@dataclass(frozen=True)
class TokenInfo:
    """One generated token with its log-probabilities (only when the request asks for them)."""

    token: int
    logprobs: TokenLogprobs


@dataclass(frozen=True)
class TextDelta:
    """New answer text, safe to send, and the tokens it completes (when log-probabilities are asked for).

    A token's text may be held back (an incomplete character, a possible stop
    string); its log-probabilities go out with the delta that releases its text.
    """

    text: str
    tokens: tuple[TokenInfo, ...] = ()
    ids: tuple[int, ...] = ()
    """Every token fed since the previous delta (whose text this one completes)."""
    echo: Echo | None = None
    """On the first delta of a completion that echoes its prompt: the prompt, given back before ``text``."""


@dataclass(frozen=True)
class Echo:
    """A completion's prompt given back (``echo``): its text, its ids and, when asked for, their log-probabilities
    (the first token has none: nothing precedes it)."""

    text: str
    ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class Finished:
    """The answer is complete."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


GenerationEvent = TextDelta | Finished


def pick_seed(requested: int | None) -> int:
    """The sampler seed: the request's (as ``torch.manual_seed`` would take it), else a random one."""
    if requested is None:
        return secrets.randbits(63)
    seed = requested % (1 << 64)  # torch seeds are unsigned 64-bit; negative seeds wrap as in torch
    return seed if seed <= MAX_SEED else seed & MAX_SEED

