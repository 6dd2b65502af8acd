"""Incremental detokenisation: turn a stream of token ids into a stream of text.

A token is not a unit of text. With a byte-level BPE one character may span
several tokens (a multi-byte UTF-8 character split across them), and decoding
a token alone gives U+FFFD. Streaming must therefore hold text back until it
is complete, and never emit a piece that a later token would change.

:class:`IncrementalDetokenizer` keeps a small window of ids: the ids of the
last emitted piece (``prefix``, as context so that tokenizers which drop a
leading space at the start of a decode still see it) and the ids not yet
emitted (``read`` onwards). Each new id decodes the window; whatever text the
window adds beyond the context is emitted when it does not end in an
incomplete character. The cost of a step is bounded by the window, not the
length of the answer. The concatenation of everything emitted, plus
:meth:`flush` at the end, is the answer's text: streamed and non-streamed
answers are built from it, so they are equal by construction.
"""

from __future__ import annotations

from typing import Final, Protocol

REPLACEMENT_CHAR: Final = "\ufffd"
"""What a decoder gives for an incomplete UTF-8 sequence."""
MAX_PENDING_TOKENS: Final = 8
"""Tokens held back at most; a UTF-8 character is at most 4 bytes, so more means truly invalid bytes."""


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool | None = ...) -> str: ...


class IncrementalDetokenizer:
    """Decodes one answer's tokens as they come, emitting only complete text."""

    def __init__(self, tokenizer: Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the context window: the ids of the last emitted piece."""
        self._read = 0
        """First id whose text has not been emitted yet."""
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    @property
    def token_count(self) -> int:
        """Tokens pushed so far."""
        return len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often ``""`` mid-character)."""
        self._ids.append(token_id)
        return self._advance(final=len(self._ids) - self._read > MAX_PENDING_TOKENS)

    def flush(self) -> str:
        """At the end of the answer: whatever is still held back, complete or not."""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if not window.startswith(context):
            # The new ids changed how the context decodes; emit only what cannot change any more.
            if not final:
                return ""
            context = ""
            window = self._decode(self._ids[self._read:])
        if not final and (len(window) <= len(context) or window.endswith(REPLACEMENT_CHAR)):
            return ""
        piece = window[len(context):]
        self._prefix, self._read = self._read, len(self._ids)
        if piece:
            self._pieces.append(piece)
        return piece
