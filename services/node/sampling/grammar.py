"""Structured outputs: the grammar that constrains a session's tokens, enforced by llguidance.

The head compiles a request's ``response_format`` into an llguidance grammar
(:func:`grammar_for_schema`), checks that the engine can build it (a 400
naming the problem otherwise) and sends it to the tail inside
``X-Meshnet-Sampling``. The tail builds a :class:`Constraint` for the session:
before each token is drawn it masks the logits to the tokens the grammar
allows, and after the draw it advances the grammar by the chosen token. A
finished grammar allows only the end-of-sequence token, so the answer ends
where the JSON does.

The grammar's state is a function of the tokens generated so far, nothing
else: a tail rebuilt by failover (or a head continuing a stream) feeds it the
generated ids (``X-Meshnet-Sample-Ids``) before it samples, and the mask of
every later step is the one an uninterrupted run would have used.

Why llguidance and not xgrammar: both are maintained engines that vLLM and
SGLang use. llguidance 1.9 is one 3 MB wheel with no dependencies; xgrammar
0.2.8 pulls triton and apache-tvm-ffi into a CPU-only torch install. llguidance
computes a mask in tens of microseconds without precomputation, compiles a
JSON schema lazily (no per-schema warm-up that would stall a tail), has
explicit resource limits (:data:`PARSER_LIMITS`) for grammars that arrive over
the wire, and says which keyword of a schema it cannot enforce.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import AutoTokenizer

logger = logging.getLogger(__name__)

JSON_OPTIONS: Final = {"whitespace_flexible": False}
"""Compact JSON: no whitespace between tokens. A model cannot pad an answer with endless blanks (a known way
for constrained decoding to run to ``max_tokens``), and the answer is what ``json.dumps(separators=(",", ":"))``
would write."""
ANY_OBJECT: Final = {"type": "object"}
"""The schema of ``{"type": "json_object"}``: any JSON object."""
PARSER_LIMITS: Final = llguidance.LLParserLimits(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=100_000,
    verbose_errors=False,
)
"""What one grammar may cost: lexer fuel per mask, Earley items per step, lexer states (1-2 KB each), grammar
symbols. A grammar over them fails to build (a 400 at the head) or ends its session (a 400 mid-stream), never
the node."""


class GrammarError(ValueError):
    """A grammar the engine cannot build or follow: the request's fault (a 400)."""


def grammar_for_schema(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of answers that are JSON matching ``schema`` (``None``: any JSON object)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT if schema is None else schema,
                                                             overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None


def check_grammar(grammar: str) -> None:
    """Raise :class:`GrammarError` naming the problem when the engine cannot build ``grammar``."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=PARSER_LIMITS)
    if is_error:
        raise GrammarError(f"the JSON schema cannot be enforced: {_short(messages[0] if messages else 'unknown error')}")


class GrammarEngine:
    """The served model's tokenizer as llguidance sees it, built once on first use (about a second)."""

    def __init__(self, model_path: Path, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._path = model_path
        self._vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """True once the tokenizer is built (:meth:`prepare`): :meth:`constraint` will not block."""
        return self._tokenizer is not None

    def prepare(self) -> llguidance.LLTokenizer:
        """Build the tokenizer if it is not yet (blocking: call it from a thread)."""
        with self._lock:
            if self._tokenizer is None:
                hf = AutoTokenizer.from_pretrained(self._path)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self._vocab_size,
                                                               eos_token=self._eos or None)
                logger.info("grammar engine ready: llguidance %s, %d tokens", llguidance.__version__,
                            self._vocab_size)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """:func:`check_grammar` against this model's tokens."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.prepare(),
                                                                                 limits=PARSER_LIMITS)
        if is_error:
            raise GrammarError(f"the JSON schema cannot be enforced: "
                               f"{_short(messages[0] if messages else 'unknown error')}")

    def constraint(self, grammar: str, generated: Sequence[int] = ()) -> Constraint:
        """The grammar state of a session that has generated ``generated`` so far."""
        matcher = llguidance.LLMatcher(self.prepare(), grammar, log_level=0, limits=PARSER_LIMITS)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be built: {_short(matcher.get_error())}")
        constraint = Constraint(matcher, self._vocab_size)
        for token in generated:
            constraint.advance(token)
        return constraint


class Constraint:
    """One session's grammar state: which tokens may come next. Used by one session's sampler only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (``[1, vocab]`` float32) with every token the grammar forbids set to ``-inf``."""
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {_short(self._matcher.get_error())}")
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(words, bitorder="little")[: scores.shape[-1]].astype(bool)
        if self._matcher.is_error():  # a mask over its limits puts the matcher in error
            raise GrammarError(f"the grammar failed: {_short(self._matcher.get_error())}")
        if not allowed.any():
            raise GrammarError("the grammar allows no next token")
        # numpy, one thread: torch's masked_fill fans a 50k-element fill out to the intra-op threads, which on
        # a busy CPU costs tens of milliseconds instead of tens of microseconds.
        kept = np.where(allowed, scores.detach().to("cpu").numpy(), np.float32(-np.inf))
        return torch.from_numpy(kept.astype(np.float32, copy=False))

    def advance(self, token: int) -> None:
        """The session produced ``token``: move the grammar past it."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {int(token)} does not follow the grammar: "
                               f"{_short(self._matcher.get_error())}")


def _short(message: str, limit: int = 300) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
