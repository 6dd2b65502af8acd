"""How many tokens a head drafts for each decode step of one request (``--speculate auto|on|off``).

A decode step along a route costs the route's round trip plus every node's
compute. A speculative step sends the last token and ``k`` drafted ones
(:mod:`services.node.drafter`) in one frame; the tail verifies them and the
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
  ms, and draft only when that beats a plain step by :data:`MIN_GAIN`. No
  drafting while the network time is under :data:`MIN_NETWORK_MS` (loopback,
  a LAN). A request whose drafts stopped paying tries one short draft every
  :data:`PROBE_EVERY` steps, so its acceptance estimate can recover.

``auto`` speculates on greedy requests only: a seeded sampled stream is
promised to equal single-process ``generate`` token for token, and
speculative sampling keeps the distribution, not that stream.

Drafts never run past ``max_tokens``: ``k`` is at most the tokens still to
generate minus one, so a session's KV never outgrows its reservation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from services.node.drafter import propose

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
INITIAL_EXTRA_SHARE: Final = 0.25
"""Compute of one extra position, as a share of a plain step's, before it was measured."""
PROBE_EVERY: Final = 16
"""Steps without a draft after which ``auto`` tries one again (while the network time is high)."""
PROBE_TOKENS: Final = 2


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


class Speculation:
    """The drafting decisions of one request, learned from its own steps."""

    def __init__(self, mode: SpeculateMode, max_k: int = DEFAULT_SPECULATE_MAX) -> None:
        if not 1 <= max_k <= MAX_SPECULATE:
            raise ValueError(f"speculate_max must be 1..{MAX_SPECULATE}, got {max_k}")
        self.mode = mode
        self.max_k = max_k
        self.acceptance = INITIAL_ACCEPTANCE
        self.network_ms: float | None = None
        self.compute_ms: float | None = None
        self.extra_ms: float | None = None
        self.stats = SpeculationStats()
        self._since_draft = 0

    def draft(self, tokens: Sequence[int], remaining: int) -> tuple[int, ...]:
        """The tokens to draft after ``tokens`` (prompt and answer so far) with ``remaining`` still to generate."""
        cap = min(self.max_k, remaining - 1)
        if self.mode == "off" or cap < 1:
            return ()
        k = cap if self.mode == "on" else self.choose_k(cap)
        return propose(tokens, k) if k else ()

    def choose_k(self, cap: int) -> int:
        """``auto``'s ``k`` for the next step (0: a plain step)."""
        if self.network_ms is None or self.compute_ms is None or self.network_ms < MIN_NETWORK_MS:
            return 0
        extra = self.extra_ms if self.extra_ms is not None else INITIAL_EXTRA_SHARE * self.compute_ms
        base = self.network_ms + self.compute_ms
        plain = 1.0 / base
        best_k, best = 0, plain * MIN_GAIN
        for k in range(1, cap + 1):
            expected = float(k + 1) if self.acceptance >= 1.0 else (1 - self.acceptance ** (k + 1)) / (1 - self.acceptance)
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
        self.acceptance = _ema(self.acceptance, accepted / drafted)
        if self.compute_ms is not None:
            self.extra_ms = _ema(self.extra_ms, max(compute_ms - self.compute_ms, 0.0) / drafted)
