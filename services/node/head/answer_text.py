"""An answer's tokens turned into the text a client may be sent, as deltas.

Tokens become text incrementally (:mod:`services.node.head.detok`, never splitting a character); text that
may begin a stop string is held back (:mod:`services.node.head.stops`). A token's log-probabilities and id
go out with the delta that releases its text, and a completion's echoed prompt with the first delta.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.node.head.events import Echo, TextDelta, TokenInfo
from services.node.head.stops import StopMatcher
from services.node.head.tokens import HeadTokenizer
from services.node.sampling.sampler import Pick


class AnswerText:
    """One answer's text so far: feed it tokens, take the deltas that may go out."""

    def __init__(self, tokenizer: HeadTokenizer, stop: Sequence[str]) -> None:
        self._detok = tokenizer.detokenizer()
        self._stops = StopMatcher(stop)
        self._fed: list[int] = []
        """Tokens fed since the last delta."""
        self._pending: list[TokenInfo] = []
        """Log-probabilities of tokens whose text has not gone out yet."""
        self.echo: Echo | None = None
        """The prompt a completion echoes, until the first delta carries it."""
        self.stopped = False
        """Whether a stop string ended the answer."""

    def replay(self, ids: Sequence[int]) -> str:
        """Rebuild the text state of ``ids`` already sent (a continued answer's, ``meshwire.resume``); their text."""
        return "".join(self._stops.feed(self._detok.push(token)).text for token in ids)

    def push(self, pick: Pick) -> TextDelta | None:
        """Feed one generated token (not an EOS); the delta it releases, if any. Sets :attr:`stopped` when a stop
        string matched: feed nothing more then."""
        if pick.logprobs is not None:
            self._pending.append(TokenInfo(pick.token, pick.logprobs))
        self._fed.append(pick.token)
        out = self._stops.feed(self._detok.push(pick.token))
        self.stopped = out.stopped
        return self._delta(out.text) if out.text else None

    def finish(self) -> TextDelta | None:
        """At the end: what was held back for a character or a stop string (and what no delta carried yet).
        Sets :attr:`stopped` when the held text completes a stop string."""
        if self.stopped:
            return None
        out = self._stops.feed(self._detok.flush())
        rest = out.text if out.stopped else out.text + self._stops.flush()
        self.stopped = out.stopped
        if rest or self._pending or self.echo is not None:
            return self._delta(rest)
        return None

    def _delta(self, text: str) -> TextDelta:
        """The echo goes out with the first text (and the ids a continuation must not repeat)."""
        delta = TextDelta(text, tuple(self._pending), tuple(self._fed), self.echo)
        self.echo = None
        self._pending.clear()
        self._fed.clear()
        return delta


def sent_text(tokenizer: HeadTokenizer, stop: Sequence[str], ids: Sequence[int]) -> str:
    """The text a head sent for generated ``ids`` (those a continuation replays, ``meshwire.resume``): what
    the detokenizer and the stop matcher let out for them, as the generation loop rebuilds it."""
    return AnswerText(tokenizer, stop).replay(ids)
