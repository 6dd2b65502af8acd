"""How many tokens a head drafts for each decode step of one request (``--speculate auto|on|off``).

Drafts come from the head's draft model (``--draft-model``,
:mod:`services.node.head.draft_model`) when it has one, else from prompt lookup
(:mod:`services.node.head.drafter`).

A decode step along a route costs the route's round trip plus every node's
compute. A speculative step sends the last token and ``k`` drafted ones
(:mod:`services.node.head.drafter`) in one frame; the tail verifies them and the
step yields the accepted drafts plus one token, at the price of the same round
trip and ``k`` more positions of compute. Where round trips are long and drafts
are often right, that is several tokens for the price of one step; on loopback,
where a step is nearly all compute, it is a loss.

* ``off``: never draft.
* ``on``: draft whenever the drafter has a proposal, up to ``--speculate-max``
  tokens (for tests and benchmarks).
* ``auto``: per request, keep running estimates of the step's network time
  (wall time minus the nodes' compute, from ``node_timings_ms``), the compute
  of a plain step and of each extra position, and the acceptance rate of
  drafts; before each step pick the ``k`` that maximises expected tokens per
  second, ``(1 - a^(k+1)) / (1 - a)`` tokens over ``net + compute + k x extra``
  ms, and draft only when that beats a plain step by :data:`MIN_GAIN`. The
  acceptance ``a`` is per drafted token: of the drafts the tail judged (those
  up to and including the first it rejected), the share it accepted; and it
  is kept per source of drafts (the draft model; prompt lookup matching 1, 2,
  3 or 4 tokens), since a proposal that matched 4 tokens is right far more
  often than one that matched 1. The draft model's own time per token counts
  as part of ``extra``. No
  drafting while the network time is under :data:`MIN_NETWORK_MS` (loopback,
  a LAN), nor while the head generates for more than
  :data:`MAX_BUSY_REQUESTS` requests at once (batching their rows pays more,
  and waiting for the others' turns would read as network time). A request whose drafts stopped paying tries one short draft every
  :data:`PROBE_EVERY` steps, so its acceptance estimate can recover.

``auto`` speculates on greedy requests only: a seeded sampled stream is
promised to equal single-process ``generate`` token for token, and
speculative sampling keeps the distribution, not that stream.

Drafts never run past ``max_tokens``: ``k`` is at most the tokens still to
generate minus one, so a session's KV never outgrows its reservation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from services.node.head.draft_model import DraftModel, DraftSession
from services.node.head.drafter import propose_match

SpeculateMode = Literal["auto", "on", "off"]
DEFAULT_SPECULATE_MAX: Final = 4
MAX_SPECULATE: Final = 16
"""Largest ``--speculate-max`` (``meshwire.forward_step.MAX_DRAFT_TOKENS``)."""
MIN_NETWORK_MS: Final = 5.0
"""Below this much network time a step, ``auto`` does not draft (loopback, a LAN)."""
MIN_GAIN: Final = 1.1
"""``auto`` drafts only when the expected tokens/s beat a plain step's by this factor."""
SMOOTHING: Final = 0.2
"""Weight of the newest step in every running estimate."""
INITIAL_ACCEPTANCE: Final = 0.5
"""Acceptance rate assumed before the first draft was verified."""
PRIOR_TRIALS: Final = 2.0
"""Weight of :data:`INITIAL_ACCEPTANCE`, in drafted tokens judged: the first verified drafts soon outweigh it."""
INITIAL_EXTRA_SHARE: Final = 0.25
"""Compute of one extra position, as a share of a plain step's, before it was measured."""
PROBE_EVERY: Final = 16
"""Steps without a draft after which ``auto`` tries one again (while the network time is high)."""
PROBE_TOKENS: Final = 2
MAX_BUSY_REQUESTS: Final = 2
"""``auto`` drafts only while at most this many requests are generating on this head. With more, the head's
step engine batches their decode rows, a speculative step runs alone at every node (it breaks the batch), and
the time a step waits for the others' turns reads as network time, which would make drafting look worthwhile
exactly when it costs the most (vLLM turns speculation off by batch size for the same reason)."""


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class SpeculationStats:
    """What a request's speculation did: steps, drafted and accepted tokens, the last ``k`` chosen."""

    steps: int = 0
    speculative_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    last_k: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class _Acceptance:
    """A decayed count of judged drafted tokens and of the accepted ones among them."""

    def __init__(self) -> None:
        self.accepted = INITIAL_ACCEPTANCE * PRIOR_TRIALS
        self.trials = PRIOR_TRIALS

    @property
    def rate(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else INITIAL_ACCEPTANCE

    def add(self, accepted: int, judged: int) -> None:
        self.accepted = (1 - SMOOTHING) * self.accepted + accepted
        self.trials = (1 - SMOOTHING) * self.trials + judged


DraftSource = str
"""Where a draft came from: ``"model"`` (the draft model) or ``"ngram-N"`` (prompt lookup matching N tokens)."""


class Speculation:
    """The drafting decisions of one request, learned from its own steps."""

    def __init__(self, mode: SpeculateMode, max_k: int = DEFAULT_SPECULATE_MAX, *,
                 model: DraftModel | None = None, busy: Callable[[], int] | None = None) -> None:
        if not 1 <= max_k <= MAX_SPECULATE:
            raise ValueError(f"speculate_max must be 1..{MAX_SPECULATE}, got {max_k}")
        self.mode = mode
        self.max_k = max_k
        self._busy = busy
        """How many requests are generating on this head now (``auto`` stands down above
        :data:`MAX_BUSY_REQUESTS`); ``None``: not known, never stands down for it."""
        self._model = model
        self._model_session: DraftSession | None = None
        self.draft_ms: float | None = None
        """The draft model's time per drafted token (``None``: no model draft yet)."""
        self._overall = _Acceptance()
        self._by_source: dict[DraftSource, _Acceptance] = {}
        """Acceptance per draft source: a prompt-lookup draft that matched 4 tokens is right far more often
        than one that matched 1 (which on a copying answer is most of the difference between a good and a
        bad draft), so ``auto`` judges each proposal by its own kind's record."""
        self._last_source: DraftSource | None = None
        self.network_ms: float | None = None
        self.compute_ms: float | None = None
        self.extra_ms: float | None = None
        self.stats = SpeculationStats()
        self._since_draft = 0

    async def draft(self, tokens: Sequence[int], remaining: int) -> tuple[int, ...]:
        """The tokens to draft after ``tokens`` (prompt and answer so far) with ``remaining`` still to generate:
        the draft model's (``--draft-model``) where the head has one and a session of it is free, else prompt
        lookup's. ``auto`` sizes the draft by the record of its source (:meth:`choose_k`)."""
        cap = min(self.max_k, remaining - 1)
        self._last_source = None
        if self.mode == "off" or cap < 1:
            return ()
        if self.mode == "auto" and (not self._network_pays() or self._batching()):
            return ()
        if self._model is not None and self._model_session is None:
            self._model_session = self._model.session()
        k = 0 if self._model_session is None else cap if self.mode == "on" else self.choose_k(cap, "model")
        if self._model_session is not None and k:
            began = time.perf_counter()
            drafted = await self._model_session.propose(tokens, k)
            if drafted:
                self.draft_ms = _ema(self.draft_ms, (time.perf_counter() - began) * 1000.0 / len(drafted))
                self._last_source = "model"
                return drafted
        proposal, matched = propose_match(tokens, cap)
        if not proposal:
            return ()
        source = f"ngram-{matched}"
        k = len(proposal) if self.mode == "on" else self.choose_k(len(proposal), source)
        if k:
            self._last_source = source
        return proposal[:k]

    def close(self) -> None:
        """Free the request's draft-model session (the request ended)."""
        if self._model_session is not None:
            self._model_session.close()
            self._model_session = None

    @property
    def acceptance(self) -> float:
        """The estimated chance that a drafted token is accepted, given the ones before it were (every source)."""
        return self._overall.rate

    def acceptance_of(self, source: DraftSource | None) -> float:
        """:attr:`acceptance` of drafts from ``source`` (all drafts' until that source has a record)."""
        record = self._by_source.get(source) if source is not None else None
        return self._overall.rate if record is None else record.rate

    def describe(self) -> str:
        """The estimates behind ``auto``'s choice (for debug logs)."""
        def ms(value: float | None) -> str:
            return "?" if value is None else f"{value:.1f} ms"
        sources = ", ".join(f"{name} {record.rate:.2f}" for name, record in sorted(self._by_source.items()))
        return (f"acceptance {self.acceptance:.2f} ({sources or 'no drafts yet'}), network {ms(self.network_ms)}, "
                f"compute {ms(self.compute_ms)}, extra {ms(self.extra_ms)} a position, draft {ms(self.draft_ms)} a "
                f"token; {self.stats.accepted}/{self.stats.drafted} drafts accepted in "
                f"{self.stats.speculative_steps}/{self.stats.steps} steps")

    def stop(self) -> None:
        """Draft no more for this request (its route cannot verify drafts)."""
        self.mode = "off"

    def _batching(self) -> bool:
        """Whether the head is generating for more than :data:`MAX_BUSY_REQUESTS` requests (batching beats drafting)."""
        return self._busy is not None and self._busy() > MAX_BUSY_REQUESTS

    def _network_pays(self) -> bool:
        """Whether steps have been measured and their network time is worth saving (not loopback, not a LAN)."""
        return self.network_ms is not None and self.compute_ms is not None and self.network_ms >= MIN_NETWORK_MS

    def choose_k(self, cap: int, source: DraftSource | None = None) -> int:
        """``auto``'s ``k`` for the next step (0: a plain step), for a draft from ``source``."""
        if not self._network_pays():
            return 0
        assert self.network_ms is not None and self.compute_ms is not None
        extra = self.extra_ms if self.extra_ms is not None else INITIAL_EXTRA_SHARE * self.compute_ms
        if source == "model":
            extra += self.draft_ms or 0.0  # a draft model's tokens cost the head their own forwards
        acceptance = self.acceptance_of(source)
        base = self.network_ms + self.compute_ms
        plain = 1.0 / base
        best_k, best = 0, plain * MIN_GAIN
        for k in range(1, cap + 1):
            expected = float(k + 1) if acceptance >= 1.0 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
            rate = expected / (base + k * extra)
            if rate > best:
                best_k, best = k, rate
        if best_k == 0 and self._since_draft >= PROBE_EVERY:
            return min(PROBE_TOKENS, cap)
        return best_k

    def observe(self, drafted: int, emitted: int, wall_ms: float, compute_ms: float) -> None:
        """A decode step drafted ``drafted`` tokens and emitted ``emitted``, in ``wall_ms`` with ``compute_ms``
        of compute on the nodes together."""
        self.stats.steps += 1
        self.stats.last_k = drafted
        self.network_ms = _ema(self.network_ms, max(wall_ms - compute_ms, 0.0))
        if drafted == 0:
            self._since_draft += 1
            self.compute_ms = _ema(self.compute_ms, compute_ms)
            return
        self._since_draft = 0
        accepted = max(0, min(emitted - 1, drafted))
        self.stats.speculative_steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        # Each drafted token is a trial until the first rejection; the ones after it were never judged. So the
        # per-token acceptance is accepted / (accepted + rejections), not accepted / drafted (which, at k 4 and a
        # true rate of 0.8, reads 0.59 and keeps k low exactly where drafts are good).
        judged = accepted + (1 if accepted < drafted else 0)
        self._overall.add(accepted, judged)
        if self._last_source is not None:
            self._by_source.setdefault(self._last_source, _Acceptance()).add(accepted, judged)
        if self.compute_ms is not None:
            self.extra_ms = _ema(self.extra_ms, max(compute_ms - self.compute_ms, 0.0) / drafted)
