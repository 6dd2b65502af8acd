"""Stop sequences, matched on text as it streams.

OpenAI semantics: generation ends at the first occurrence of any stop string,
and the stop string itself is not part of the answer. Streaming makes this
subtle: text that might be the beginning of a stop string cannot be sent yet,
because the next token may complete the stop string (and then it must never
have been sent). :class:`StopMatcher` holds back exactly the longest tail of
the text that is a prefix of some stop string, and releases it as soon as it
cannot be one any more, or at the end of the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    """What :meth:`StopMatcher.feed` lets out: text safe to emit, and whether a stop string was hit."""

    text: str
    stopped: bool


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self._stopped = False

    @property
    def held(self) -> str:
        """Text received but not let out yet."""
        return self._held

    def feed(self, text: str) -> StopResult:
        """Add streamed ``text``; return what may be emitted now and whether generation must stop."""
        if self._stopped:
            return StopResult("", True)
        if not self._stops:
            return StopResult(text, False)
        window = self._held + text
        hit = min((i for i in (window.find(s) for s in self._stops) if i >= 0), default=-1)
        if hit >= 0:
            self._stopped = True
            self._held = ""
            return StopResult(window[:hit], True)
        keep = self._longest_partial(window)
        self._held = window[len(window) - keep:] if keep else ""
        return StopResult(window[:len(window) - keep], False)

    def flush(self) -> str:
        """At the end of generation: the held text, which can no longer start a stop string."""
        out, self._held = ("" if self._stopped else self._held), ""
        return out

    def _longest_partial(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(window)), best, -1):
                if window.endswith(stop[:size]):
                    best = size
                    break
        return best
