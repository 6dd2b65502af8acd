"""Tests of real components that ``make setup`` installs: skipped with the reason on a developer's machine
that lacks one, a failure under ``CI=1`` (where setup must have installed it).

``needs(available, reason)`` is a ``pytestmark`` (or a test's decorator): where the component is present it
marks nothing; where it is missing it is a skip saying why, or on CI the ``missing_on_ci`` marker, which
``tests/conftest.py`` turns into a failure naming the component. What a machine cannot have (a CPU feature,
a GPU) is a plain ``skipif``, never this.
"""

from __future__ import annotations

import os

import pytest

MISSING_ON_CI = "missing_on_ci"
"""The marker ``tests/conftest.py`` fails a test for, with the marker's reason."""


def on_ci() -> bool:
    """Whether this run is CI's (``CI`` set, as ``.ci/run`` does): installable components must be there."""
    return bool(os.environ.get("CI"))


def needs(available: bool, reason: str) -> pytest.MarkDecorator:
    """A mark for a test that needs an installable component: nothing, a skip, or (on CI) a failure."""
    if available:
        return pytest.mark.skipif(False, reason=reason)
    if on_ci():
        return getattr(pytest.mark, MISSING_ON_CI)(f"{reason}; CI=1: `make setup` must install it")
    return pytest.mark.skipif(True, reason=reason)


def require(available: bool, reason: str) -> None:
    """The same inside a test or fixture: return where present, else skip (fail on CI) with the reason."""
    if available:
        return
    if on_ci():
        pytest.fail(f"{reason}; CI=1: `make setup` must install it")
    pytest.skip(reason)
