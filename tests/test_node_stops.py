"""Stop sequences on streamed text: the stop string is never emitted, and neither is a prefix of it."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from services.node.head.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Feed ``pieces`` one by one; the emitted text (final flush included) and whether it stopped."""
    matcher = StopMatcher(stops)
    out: list[str] = []
    for piece in pieces:
        result = matcher.feed(piece)
        out.append(result.text)
        if result.stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_text_before_the_stop_string_is_emitted_and_the_stop_string_is_not() -> None:
    assert run(["END"], ["hello ", "wor", "ld E", "ND and more"]) == ("hello world ", True)


def test_a_possible_start_of_a_stop_string_is_held_back() -> None:
    matcher = StopMatcher(["\nUser:"])
    assert matcher.feed("Sure.\nUs").text == "Sure."
    assert matcher.held == "\nUs"


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    matcher = StopMatcher(["\nUser:"])
    matcher.feed("Sure.\nUs")
    assert matcher.feed("eful").text == "\nUseful"


def test_held_back_text_is_released_at_the_end() -> None:
    assert run(["STOP"], ["the end ST"]) == ("the end ST", False)


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert run(["world", "lo w"], ["hello world"]) == ("hel", True)


def test_without_stop_strings_text_passes_straight_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("anything").text == "anything"
    assert matcher.held == ""


@given(text=st.text(alphabet="abc", max_size=40), stop=st.text(alphabet="abc", min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_streaming_in_any_pieces_equals_cutting_the_whole_text_at_the_first_stop(
        text: str, stop: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    index = text.find(stop)
    expected = (text, False) if index < 0 else (text[:index], True)
    assert run([stop], pieces) == expected
