"""Shared pytest fixtures for the meshnet suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    """Turn SIGTERM (``timeout``, a CI runner giving up) into KeyboardInterrupt, so pytest tears its fixtures
    down and every service a test started is stopped, instead of living on with no parent."""
    import signal

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build meshnet's quantized-product kernel once before any node starts (a no-op once built): nodes
    started by tests would otherwise each wait on the build inside their start-up time."""
    import logging

    from services.node.model.quant import quant_kernel

    try:
        quant_kernel.build()
    except Exception as error:  # noqa: BLE001 - the nodes then use torch's kernel and log why
        logging.getLogger(__name__).warning("meshnet's quantized-product kernel is not built: %s", error)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail, under ``CI=1``, a test whose installable component is missing (``tests/requirements.py``)."""
    from tests.requirements import MISSING_ON_CI

    mark = item.get_closest_marker(MISSING_ON_CI)
    if mark is not None:
        pytest.fail(str(mark.args[0]))


# --- tiny model (owned by the node compute core) -----------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny deterministic Llama model (tests/tiny_model.py), built once per test session."""
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> PreTrainedModel:
    """The tiny model in float32, single process: what the mesh must equal token for token."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    """The tiny model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --- end tiny model ------------------------------------------------------------------------------------


# --- Redis (owned by the tracker store) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """URL of a real, empty ``redis-server`` for the module (skips where none is installed; fails on CI)."""
    from tests.redis_server import redis_server

    with redis_server() as server:
        yield server.url


# --- end Redis ------------------------------------------------------------------------------------------
