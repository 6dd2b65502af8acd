"""The head's text side: prompt to token ids, end-of-sequence ids, ids back to text.

Chat prompts go through the model's own chat template with the generation
prompt appended, exactly as ``apply_chat_template(..., add_generation_prompt=True)``
does for single-process transformers, so both see the same ids. Raw
``/v1/completions`` prompts are tokenised as they are (with the tokenizer's
special tokens, e.g. a BOS, as ``tokenizer(prompt)`` adds them).

End of sequence follows ``generate``: the ids of the model's generation
config (``generation_config.json``, else the model config), which may be a list.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from services.node.head.detok import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class TemplateError(ValueError):
    """The chat template could not render these messages (answered as a 400)."""


class HeadTokenizer:
    """Tokenizer, chat template and EOS ids of the served model."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_ids: frozenset[int] = frozenset(eos_ids)

    @classmethod
    def from_folder(cls, path: Path, config: PretrainedConfig) -> HeadTokenizer:
        """Load the tokenizer in ``path`` and the EOS ids ``generate`` would use."""
        tokenizer = AutoTokenizer.from_pretrained(path)
        eos = eos_ids_of(path, config)
        if not eos:
            logger.warning("the model names no end-of-sequence token: answers end at max_tokens or a stop string")
        return cls(tokenizer, eos)

    @property
    def vocabulary(self) -> dict[str, int]:
        """The tokenizer's vocabulary (token to id), added tokens included: what a draft model must share."""
        return dict(self._tokenizer.get_vocab())

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    @property
    def supports_tools(self) -> bool:
        """True when the chat template renders a ``tools`` list (as tool-calling models' templates do)."""
        template = getattr(self._tokenizer, "chat_template", None)
        return isinstance(template, str) and _TOOLS_IN_TEMPLATE.search(template) is not None

    def encode_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Ids of ``messages`` rendered with the chat template and the generation prompt; ``tools`` (OpenAI's
        ``{"type": "function", "function": {...}}`` entries) are given to the template to show the model."""
        if not self.has_chat_template:
            raise TemplateError("this model has no chat template; use /v1/completions with a raw prompt")
        try:
            ids: Any = self._tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
        except Exception as exc:  # jinja raises its own exception types for unsupported conversations
            raise TemplateError(f"the chat template cannot render these messages: {exc}") from exc
        return [int(i) for i in ids]

    def encode_text(self, prompt: str) -> list[int]:
        """Ids of a raw prompt, with the special tokens the tokenizer adds by itself."""
        return [int(i) for i in self._tokenizer(prompt).input_ids]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens skipped)."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_bytes(self, token: int) -> bytes:
        """The bytes token ``token`` stands for (a byte-level BPE piece may be part of a character).

        Byte-level tokenizers (GPT-2 style: ``Ġ`` for a space) map each piece
        character back to one byte; other tokenizers give the UTF-8 of the
        token's decoded text.
        """
        piece = self._tokenizer.convert_ids_to_tokens(int(token))
        if isinstance(piece, str) and piece and all(char in _BYTE_OF_CHAR for char in piece):
            return bytes(_BYTE_OF_CHAR[char] for char in piece)
        return self._tokenizer.decode([int(token)], skip_special_tokens=False).encode()

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh incremental detokeniser for one answer."""
        return IncrementalDetokenizer(self._tokenizer)


_TOOLS_IN_TEMPLATE: Final = re.compile(r"\btools\b")
"""A template that reads the ``tools`` variable (Jinja) is one that can show the model its tools."""


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: the character each byte is written as in a byte-level piece."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


_BYTE_OF_CHAR: Final = _byte_level_alphabet()


def eos_ids_of(path: Path, config: PretrainedConfig) -> set[int]:
    """The end-of-sequence ids ``generate`` would stop on for the model in ``path``."""
    eos: Any = None
    if (path / "generation_config.json").is_file():
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except (OSError, ValueError) as exc:
            logger.warning("unreadable generation_config.json in %s: %s", path, exc)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}
