"""A model-free drafter: prompt lookup (n-gram matching over the conversation so far).

Answers often copy: a code edit repeats the code, a summary quotes its text, a
list repeats its own structure. When the last ``n`` tokens of the conversation
(prompt and answer so far) also occur earlier, the tokens that followed that
earlier occurrence are a good guess of what comes next. The drafter tries the
longest n-gram first (:data:`MAX_NGRAM` down to :data:`MIN_NGRAM`), takes the
most recent earlier occurrence, and proposes up to ``k`` tokens after it. It
costs no model and no memory beyond the token list the head already keeps, and
it proposes nothing where nothing repeats (then a step is an ordinary one).

The search looks at most :data:`MAX_LOOKBACK` tokens back, so a draft costs
a bounded amount of work however long the conversation grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

MAX_NGRAM: Final = 4
"""Longest suffix matched."""
MIN_NGRAM: Final = 1
"""Shortest suffix matched (as transformers' prompt lookup: a lone token is the weakest guess, tried last)."""
MAX_LOOKBACK: Final = 4096
"""Tokens searched back from the end for an earlier occurrence."""


def propose(tokens: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    return propose_match(tokens, k, max_ngram=max_ngram, min_ngram=min_ngram)[0]


def propose_match(tokens: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM,
                  min_ngram: int = MIN_NGRAM) -> tuple[tuple[int, ...], int]:
    """:func:`propose`'s tokens and the length of the suffix they matched (0 with no proposal): a longer match
    is a better guess, and ``auto`` keeps a record per length."""
    if k < 1 or len(tokens) <= min_ngram:
        return (), 0
    window = list(tokens[-MAX_LOOKBACK:])
    end = len(window)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix = window[end - n:]
        first = suffix[0]
        for start in range(end - n - 1, -1, -1):  # the most recent earlier occurrence first
            if window[start] == first and window[start:start + n] == suffix:
                follow = window[start + n:start + n + k]
                if follow:
                    return tuple(follow), n
    return (), 0
