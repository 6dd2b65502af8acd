"""A request the bootstrap service refuses: an HTTP status and a plain-text message.

The reference server answers every refusal as ``text/plain`` with a short
message, and uses 500 for all of them except a query with missing inputs
(400). Its clients only log the text, so the texts are part of the contract
and live here, next to the exception that carries them.
"""

from __future__ import annotations

from typing import Final

INTERNAL: Final = 500
"""The reference's status for every refusal it does not name otherwise."""
BAD_REQUEST: Final = 400
NOT_FOUND: Final = 404
METHOD_NOT_ALLOWED: Final = 405
REQUEST_TIMEOUT: Final = 408
PAYLOAD_TOO_LARGE: Final = 413
INSUFFICIENT_STORAGE: Final = 507

# --- the reference's texts ----------------------------------------------------
NOT_JSON: Final = "the registration is not JSON"
DP_SIZE_ZERO: Final = "dp_size must not be zero"
WORLD_BELOW_DP: Final = "world_size must not be below dp_size"
MISSING_INPUTS: Final = "Missing inputs for bootstrap server."
RANK_NOT_FOUND: Final = "Bootstrap info not Found"
PATH_NOT_FOUND: Final = "Not Found"
WRONG_METHOD: Final = "Method not allowed"


def missing(key: str) -> str:
    """The text refusing a registration without ``key``."""
    return f"missing {key}"


def not_an_integer(name: str) -> str:
    """The text refusing a value of ``name`` that is not an integer."""
    return f"{name} is not an integer"


class Refusal(Exception):
    """Raised by the registry (and the request guards) to refuse a request.

    ``status`` is the HTTP status to answer and ``message`` the exact
    ``text/plain`` body.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @classmethod
    def internal(cls, message: str) -> Refusal:
        """A refusal with the reference's catch-all status, 500."""
        return cls(INTERNAL, message)

    def __repr__(self) -> str:
        return f"Refusal({self.status}, {self.message!r})"
