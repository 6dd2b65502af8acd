"""A missing installable component is a skip with its reason on a developer's machine, a failure on CI."""

from __future__ import annotations

import pytest

from tests.requirements import MISSING_ON_CI, needs, require


def test_a_present_component_marks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    mark = needs(True, "redis-server is not installed")
    assert mark.name == "skipif" and mark.args == (False,)


def test_a_missing_component_is_a_skip_that_says_why_off_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    mark = needs(False, "no Chromium on this machine")
    assert mark.name == "skipif" and mark.args == (True,) and mark.kwargs["reason"] == "no Chromium on this machine"
    with pytest.raises(pytest.skip.Exception, match="no Chromium"):
        require(False, "no Chromium on this machine")


def test_a_missing_component_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    mark = needs(False, "the native kernel did not build")
    assert mark.name == MISSING_ON_CI and "the native kernel did not build" in mark.args[0]
    with pytest.raises(pytest.fail.Exception, match="make setup"):
        require(False, "the `ip` command (iproute2) is not installed")


def test_the_suite_fails_a_test_marked_missing_on_ci(pytester: pytest.Pytester) -> None:
    """The suite's own hook (tests/conftest.py) turns the CI marker into a failure: not a skip, not a pass."""
    pytester.makeconftest("from tests.conftest import pytest_runtest_setup  # noqa: F401\n")
    pytester.makepyfile(
        "import pytest\n"
        "pytestmark = pytest.mark.missing_on_ci('no redis-server')\n"
        "def test_needs_redis():\n"
        "    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)  # a failure in setup: the run fails, nothing passes or skips
    result.stdout.fnmatch_lines(["*no redis-server*"])
