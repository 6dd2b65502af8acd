"""The prompts every benchmark sends, the same to the mesh and to single-process transformers.

:data:`DECODE_MESSAGES` asks for a long answer, so a greedy generation runs to
``max_tokens`` instead of stopping early. :func:`messages_of_length` builds a
chat whose templated prompt is a chosen number of tokens long, to measure the
cost of a token against the context it attends to.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

Message = dict[str, str]

DECODE_MESSAGES: Final[tuple[Message, ...]] = (
    {"role": "user", "content": "Write a long, detailed story about a lighthouse keeper who finds a "
                                "message in a bottle. Describe every day of her week."},
)

LONG_CONTEXT_SYSTEM: Final = "You are a storyteller."
"""Replaces the template's longer default system prompt, so the shortest chat is about 30 tokens."""
LONG_CONTEXT_INSTRUCTION: Final = "Write a long story from these notes.\n\n"
"""Short, so the shortest prompt stays near 30 tokens; a story keeps a greedy answer going."""
FILLER: Final = (
    "The river runs past the old mill and under the stone bridge before it reaches the sea. "
    "In the morning the fishermen push their boats into the water and sail beyond the harbour wall. "
    "Children walk to school along the river path, counting the ducks and throwing small stones. "
    "The baker opens her shop before sunrise, and the smell of fresh bread drifts down the street. "
    "At noon the market fills with farmers selling apples, cheese, honey and bright spring flowers. "
    "In the evening the lamps are lit one by one, and the town hall clock strikes the hour. "
)
MAX_FILLER_WORDS: Final = 20_000
"""Longest filler searched (far beyond the 2,048-token contexts measured)."""


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the prompt builder uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def prompt_token_ids(tokenizer: ChatTokenizer, messages: tuple[Message, ...] | list[Message]) -> list[int]:
    """The token ids a head node feeds the model for ``messages``: the chat template with the assistant cue."""
    encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    return list(encoded["input_ids"])


def messages_of_length(tokenizer: ChatTokenizer, target_tokens: int) -> tuple[tuple[Message, ...], int]:
    """A system-and-user chat whose templated prompt is as close to ``target_tokens`` as possible without
    exceeding it (or the shortest possible when ``target_tokens`` is below the template's own length),
    and its actual length in tokens.
    """
    if target_tokens < 1:
        raise ValueError(f"a prompt must be at least one token long, got {target_tokens}")
    words = (FILLER * (MAX_FILLER_WORDS // len(FILLER.split()) + 1)).split()[:MAX_FILLER_WORDS]

    def build(count: int) -> tuple[Message, ...]:
        return ({"role": "system", "content": LONG_CONTEXT_SYSTEM},
                {"role": "user", "content": LONG_CONTEXT_INSTRUCTION + " ".join(words[:count])})

    def length(count: int) -> int:
        return len(prompt_token_ids(tokenizer, build(count)))

    low, high = 0, len(words)
    if length(high) <= target_tokens:
        raise ValueError(f"{target_tokens} tokens is beyond the {MAX_FILLER_WORDS}-word filler")
    while low < high:  # the largest count whose prompt fits: length() grows with count
        middle = (low + high + 1) // 2
        if length(middle) <= target_tokens:
            low = middle
        else:
            high = middle - 1
    return build(low), length(low)
