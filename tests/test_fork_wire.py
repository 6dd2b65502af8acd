"""The fork headers (``meshwire.fork``): read back what is written, refuse what is not one."""

from __future__ import annotations

import pytest

from meshwire.fork import ChoiceGroup, ForkSource
from meshwire.frames import FrameError


def test_the_headers_read_back_what_they_write() -> None:
    assert ForkSource.parse(ForkSource("s-abc:1", 41).header()) == ForkSource("s-abc:1", 41)
    assert ChoiceGroup.parse(ChoiceGroup("9f0e", 2, 3).header()) == ChoiceGroup("9f0e", 2, 3)


@pytest.mark.parametrize("value", ["", "n=0;s=s-a", "n=-1;s=s-a", "n=3", "s=s-a;n=3", "n=3;s=bad id"])
def test_a_fork_header_that_is_not_one_is_a_bad_header(value: str) -> None:
    with pytest.raises(FrameError) as caught:
        ForkSource.parse(value)
    assert caught.value.code == "bad_header"


@pytest.mark.parametrize("value", ["", "g;0;1", "g;3;3", "g;0;129", "g;-1;3", "bad id;0;2", "g;0"])
def test_a_choice_group_header_that_is_not_one_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="X-Meshnet-Choice-Group"):
        ChoiceGroup.parse(value)
