"""Incremental detokenisation: streamed pieces add up to the decoded answer, characters are never split."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from services.node.head.detok import REPLACEMENT_CHAR, IncrementalDetokenizer

MULTI_BYTE_TEXT = "Café, naïve, 日本語, emoji 🎉🚀 and ✓ marks: Ωμέγα"


def stream(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Every piece the detokeniser emits for ``ids``, the final flush included."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(token) for token in ids]
    pieces.append(detok.flush())
    return pieces


def test_a_multi_byte_character_split_across_tokens_is_emitted_whole(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer(MULTI_BYTE_TEXT).input_ids
    assert len(ids) > len(MULTI_BYTE_TEXT.encode()) // 2, "the tiny tokenizer should split these characters"
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == MULTI_BYTE_TEXT
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces)


def test_a_piece_is_held_back_until_its_character_is_complete(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("🎉").input_ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(token) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🎉"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_streamed_text_of_any_string_equals_the_string(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text).input_ids
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(REPLACEMENT_CHAR not in piece for piece in pieces if REPLACEMENT_CHAR not in text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_of_any_token_sequence_equals_its_decoding(tokenizer: PreTrainedTokenizerBase,
                                                                  data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=40))
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_not_emitted(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("hello").input_ids + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)) == "hello"
