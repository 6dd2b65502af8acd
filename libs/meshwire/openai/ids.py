"""The ``id`` and ``created`` of an answer: a fresh prefixed id, and the time in whole unix seconds."""

from __future__ import annotations

import time
import uuid
from typing import Literal


def new_id(prefix: Literal["chatcmpl", "cmpl"]) -> str:
    """A fresh response id such as ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """The ``created`` timestamp: whole unix seconds."""
    return int(time.time())
