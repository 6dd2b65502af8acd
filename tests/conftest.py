"""Shared pytest fixtures for the meshnet suite."""

from __future__ import annotations

from pathlib import Path

import pytest

# --- tiny model (owned by the node compute core) -----------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny deterministic Llama model (tests/tiny_model.py), built once per test session."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


# --- end tiny model ------------------------------------------------------------------------------------
