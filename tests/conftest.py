"""Shared pytest fixtures for the meshnet suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# --- tiny model (owned by the node compute core) -----------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny deterministic Llama model (tests/tiny_model.py), built once per test session."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# --- end tiny model ------------------------------------------------------------------------------------


# --- Redis (owned by the tracker store) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """URL of a real, empty ``redis-server`` for the module (skips where none is installed; fails on CI)."""
    from tests.redis_server import redis_server

    with redis_server() as server:
        yield server.url


# --- end Redis ------------------------------------------------------------------------------------------
