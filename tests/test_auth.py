"""Shared-secret bearer authentication: 401 without a credential, 403 with a wrong one."""

from __future__ import annotations

import pytest

from meshwire.auth import AuthFailure, bearer_headers, check_bearer

SECRET = "s3cret-value"


def test_the_right_bearer_secret_passes():
    assert check_bearer(f"Bearer {SECRET}", SECRET) is None


def test_the_scheme_is_case_insensitive_as_http_says():
    assert check_bearer(f"bearer {SECRET}", SECRET) is None


def test_bearer_headers_produce_a_passing_authorization():
    assert check_bearer(bearer_headers(SECRET)["Authorization"], SECRET) is None


@pytest.mark.parametrize("value", [None, "", "Bearer", "Bearer ", f"Basic {SECRET}", SECRET, "x" * 5000])
def test_a_missing_or_malformed_credential_is_401(value):
    failure = check_bearer(value, SECRET)
    assert isinstance(failure, AuthFailure)
    assert failure.status == 401
    assert failure.error_type == "authentication_error"
    assert failure.message


@pytest.mark.parametrize("value", ["Bearer wrong", f"Bearer {SECRET}x", f"Bearer {SECRET[:-1]}", "Bearer été"])
def test_a_wrong_credential_is_403(value):
    failure = check_bearer(value, SECRET)
    assert failure is not None and failure.status == 403
    assert failure.error_type == "permission_error"


def test_the_failure_message_does_not_echo_the_secret_or_the_attempt():
    failure = check_bearer("Bearer guess-123", SECRET)
    assert failure is not None
    assert SECRET not in failure.message and "guess-123" not in failure.message
