"""Next-token selection at the tail of a route, seeded and replayable.

The mesh promises that its output equals single-process transformers
``generate(do_sample=True, temperature=t, top_k=k, top_p=p)`` after
``torch.manual_seed(seed)``, token for token. That holds when the tail:

* warps the float32 logits with transformers' own warpers, in generate's order
  (temperature, top-k, top-p) and with generate's conditions for applying each;
* turns them into probabilities with a softmax;
* draws with exactly one ``torch.multinomial(probs, 1, generator=g)`` per token
  from a CPU generator seeded with ``seed`` (which starts in the same state as
  the global generator after ``torch.manual_seed(seed)``).

Temperature 0 means greedy decoding (argmax, no draw).

Before any of that, ``logit_bias`` is added to the logits and a structured
output's grammar (:mod:`services.node.sampling.grammar`) sets every token it forbids to
``-inf``; the grammar then moves past the chosen token. A masked draw consumes
the same generator state as any other, so the catch-up below still holds.

Speculative steps (:meth:`Sampler.verify`): the head proposes ``k`` drafted
tokens and the tail has the logits of every position. Greedy keeps the drafts
while they are the argmax, then adds its own argmax (the longest matching
prefix plus one): exactly the tokens one-at-a-time decoding picks. Sampling
uses the speculative-sampling acceptance rule (Leviathan et al. 2023, Chen et
al. 2023) for a drafter that proposes one token with certainty (a point mass
``q``): draft ``d`` is accepted with probability ``min(1, p(d)/q(d)) = p(d)``,
else a token is drawn from the residual ``max(p - q, 0)``, which is ``p``
without ``d``, renormalised. Each emitted token is then distributed exactly as
``p`` given the tokens before it, so the stream keeps the target distribution;
it is not the same stream a seed gives without speculation (the acceptance
tests use the generator too).

One multinomial draw consumes a fixed amount of generator state for a given
vocabulary size, whatever the distribution (torch samples one exponential
variate per vocabulary entry; ``tests/test_sampling.py`` checks it). A tail
rebuilt by failover therefore catches up with :meth:`Sampler.skip`, which makes
that many dummy draws over a vocabulary of the same size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from meshwire.forward_step import MAX_SAMPLE_DRAWS
from meshwire.frames import FrameError
from meshwire.headers import SAMPLE_DRAWS
from meshwire.sampling_params import LOGPROB_FLOOR, SamplingParams, TokenLogprobs
from services.node.sampling.grammar import Constraint, GrammarError

logger = logging.getLogger(__name__)

MAX_SKIP_DRAWS: Final = MAX_SAMPLE_DRAWS
"""Most draws one :meth:`Sampler.skip` call may replay (a session never makes more)."""


def check_replay_draws(draws: int, positions: int) -> None:
    """Refuse (400 ``bad_header``) a replay asking the tail to skip more draws than its request can have made.

    A draw is made per generated token, and a replay brings the whole history
    (a prompt of at least one token, then every generated token) to the frame
    that creates the sampler, so its draws are at most the positions up to the
    end of that frame, and at most :data:`MAX_SKIP_DRAWS`. Each skipped draw
    costs the tail's compute thread, which every session there shares.
    """
    if not 0 <= draws <= min(positions, MAX_SKIP_DRAWS):
        raise FrameError("bad_header", f"{SAMPLE_DRAWS} {draws} is more draws than a replay of {positions} "
                                       f"positions can have made (at most {min(positions, MAX_SKIP_DRAWS)})")


@dataclass(frozen=True)
class Pick:
    """A sampled token and, when asked for, its log-probabilities."""

    token: int
    logprobs: TokenLogprobs | None = None


class SamplingFailed(ValueError):
    """No token can be drawn from these logits with these parameters (NaN or infinite probabilities).

    It is the request's fault (its sampling parameters, or logits it drove out of
    range), never the node's: the tail answers 400 ``invalid_sampling`` and nobody
    reports the node as failed.
    """


def build_warpers(params: SamplingParams) -> LogitsProcessorList:
    """The warpers ``generate(do_sample=True, ...)`` would build for these parameters, in its order.

    Mirrors ``GenerationMixin._get_logits_processor``: temperature only when it is
    not 1, top-k only when it is not 0, top-p only when it is below 1, each with
    ``min_tokens_to_keep=1`` and the ``-inf`` filter value.
    """
    warpers = LogitsProcessorList()
    if params.greedy:
        return warpers
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return warpers


class Sampler:
    """Picks the tokens of one session; owns the session's random generator.

    Not thread-safe: a session's steps are serialised by the node.
    """

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None) -> None:
        if (params.grammar is None) != (constraint is None):
            raise ValueError("a sampler with a grammar needs its constraint, and only then")
        self.params = params
        self._constraint = constraint
        self._warpers = build_warpers(params)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(params.seed)
        self._draws = 0
        self._pending_skips = 0
        self._bias = None if not params.logit_bias else (
            torch.tensor([token for token, _ in params.logit_bias], dtype=torch.long),
            torch.tensor([bias for _, bias in params.logit_bias], dtype=torch.float32))

    @property
    def draws(self) -> int:
        """Random draws made so far, skipped ones included (what ``X-Meshnet-Sample-Draws`` carries)."""
        return self._draws + self._pending_skips

    def sample(self, logits: torch.Tensor) -> int:
        """The next token id for ``logits`` (``[vocab]``, any float dtype, any device)."""
        return self.pick(logits).token

    def pick(self, logits: torch.Tensor) -> Pick:
        """The next token for ``logits`` (``[vocab]``), with its log-probabilities when the session asks for them."""
        if logits.ndim != 1 or logits.numel() == 0:
            raise ValueError(f"logits must be a non-empty vector, got shape {tuple(logits.shape)}")
        scores = logits.to(device="cpu", dtype=torch.float32).unsqueeze(0)
        if self._bias is not None:
            scores = self._biased(scores)
        if self._constraint is not None:
            scores = self._constrained(scores)
        if self.params.greedy:
            token = int(torch.argmax(scores, dim=-1).item())
        else:
            token = self._draw(scores)
        if self._constraint is not None:
            try:
                self._constraint.advance(token)
            except GrammarError as exc:
                raise SamplingFailed(str(exc)) from None
        return Pick(token, None if self.params.logprobs is None else token_logprobs(scores[0], token,
                                                                                    self.params.logprobs))

    def _draw(self, scores: torch.Tensor) -> int:
        self._apply_pending_skips(scores.shape[-1])
        warped = self._warpers(_NO_INPUT_IDS, scores)
        probs = torch.nn.functional.softmax(warped, dim=-1)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            raise SamplingFailed(f"the sampling parameters {self.params.model_dump()} turn this step's logits into "
                                 "probabilities that are not finite: no token can be drawn")
        token = torch.multinomial(probs, num_samples=1, generator=self._generator)
        self._draws += 1
        return int(token.item())

    def verify(self, rows: torch.Tensor, draft: Sequence[int]) -> list[Pick]:
        """The tokens a speculative step emits: ``rows`` (``[k + 1, vocab]``) are the logits after each of the
        frame's positions, ``draft`` the ``k`` drafted tokens its positions 1..k hold.

        Accepted drafts, then one token the tail picks itself: greedy, its argmax
        where the draft differs (or after the last draft); sampling, a draw from
        the residual distribution where a draft is rejected (or from the last
        row's distribution when every draft was accepted).
        """
        if rows.ndim != 2 or rows.shape[0] != len(draft) + 1:
            raise ValueError(f"{len(draft)} drafted tokens need {len(draft) + 1} rows of logits, got "
                             f"{tuple(rows.shape)}")
        if self._constraint is not None:  # heads never draft for a structured output (Generator._mode_for)
            raise SamplingFailed("a structured output's tokens are not verified speculatively: send them one "
                                 "at a time")
        picks: list[Pick] = []
        for index in range(rows.shape[0]):
            scores = rows[index].to(device="cpu", dtype=torch.float32).unsqueeze(0)
            if self._bias is not None:
                scores = self._biased(scores)
            proposed = draft[index] if index < len(draft) else None
            if self.params.greedy:
                token = int(torch.argmax(scores, dim=-1).item())
            else:
                token = self._draw_against(scores, proposed)
            logprobs = None if self.params.logprobs is None else token_logprobs(scores[0], token, self.params.logprobs)
            picks.append(Pick(token, logprobs))
            if proposed is None or token != proposed:
                break
        return picks

    def _draw_against(self, scores: torch.Tensor, proposed: int | None) -> int:
        """A draw from ``scores``' distribution that accepts ``proposed`` with its probability, else the residual."""
        if proposed is None:
            return self._draw(scores)
        self._apply_pending_skips(scores.shape[-1])
        probs = torch.nn.functional.softmax(self._warpers(_NO_INPUT_IDS, scores), dim=-1)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            raise SamplingFailed(f"the sampling parameters {self.params.model_dump()} turn this step's logits into "
                                 "probabilities that are not finite: no token can be drawn")
        self._draws += 1
        vocab = probs.shape[-1]
        chance = float(probs[0, proposed]) if 0 <= proposed < vocab else 0.0
        if float(torch.rand(1, generator=self._generator)) < chance:
            return proposed
        residual = probs.clone()
        if 0 <= proposed < vocab:
            residual[0, proposed] = 0.0
        return int(torch.multinomial(residual / residual.sum(), num_samples=1, generator=self._generator).item())

    def _biased(self, scores: torch.Tensor) -> torch.Tensor:
        assert self._bias is not None
        ids, values = self._bias
        if int(ids.max()) >= scores.shape[-1]:
            raise SamplingFailed(f"logit_bias names token {int(ids.max())}, but the vocabulary has "
                                 f"{scores.shape[-1]} tokens")
        return scores.index_add(1, ids, values.unsqueeze(0))

    def _constrained(self, scores: torch.Tensor) -> torch.Tensor:
        assert self._constraint is not None
        try:
            return self._constraint.mask(scores)
        except GrammarError as exc:
            raise SamplingFailed(str(exc)) from None

    def skip(self, draws: int) -> None:
        """Advance the generator as if ``draws`` tokens had been sampled (failover catch-up).

        The draws are replayed lazily on the next :meth:`sample`, when the
        vocabulary size (which fixes how much state a draw consumes) is known.
        Greedy sessions make no draws, so skipping is a no-op for them.
        """
        if not 0 <= draws <= MAX_SKIP_DRAWS:
            raise ValueError(f"draws to skip must be in 0..{MAX_SKIP_DRAWS}, got {draws}")
        if self.params.greedy:
            return
        self._pending_skips += draws

    def _apply_pending_skips(self, vocab_size: int) -> None:
        if self._pending_skips == 0:
            return
        uniform = torch.full((1, vocab_size), 1.0 / vocab_size)
        for _ in range(self._pending_skips):
            torch.multinomial(uniform, num_samples=1, generator=self._generator)
        logger.debug("advanced sampler by %d draws (vocab %d)", self._pending_skips, vocab_size)
        self._draws += self._pending_skips
        self._pending_skips = 0


_NO_INPUT_IDS: Final = torch.empty((1, 0), dtype=torch.long)
"""The warpers we use ignore ``input_ids``; they still take the argument."""


def token_logprobs(scores: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """Log-probabilities of ``token`` and of the ``top`` likeliest tokens under ``scores`` (``[vocab]``, float32)."""
    logprobs = torch.log_softmax(scores, dim=-1)
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0].long())
    return TokenLogprobs(logprob=_floored(float(logprobs[token])),
                         top=tuple((int(i), _floored(float(v))) for i, v in zip(ids, values, strict=True)))


def _floored(value: float) -> float:
    return max(value, LOGPROB_FLOOR)
