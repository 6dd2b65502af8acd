"""A request that names no sampling parameters gets the model's recommendation, else OpenAI's defaults."""

from __future__ import annotations

import json
from pathlib import Path

from services.node.head.sampling_defaults import SamplingDefaults
from services.node.model.model_source import DEFAULT_MODEL_SAMPLING


def write_generation_config(folder: Path, config: dict) -> Path:
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_a_model_without_a_generation_config_gets_openai_defaults(tmp_path: Path) -> None:
    assert SamplingDefaults.from_folder(tmp_path) == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0)


def test_a_model_that_does_not_ask_for_sampling_gets_openai_defaults(tmp_path: Path) -> None:
    folder = write_generation_config(tmp_path, {"temperature": 0.3, "eos_token_id": 2})
    assert SamplingDefaults.from_folder(folder) == SamplingDefaults()


def test_a_model_that_recommends_sampling_gets_its_recommendation(tmp_path: Path) -> None:
    folder = write_generation_config(tmp_path, {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "top_k": 40})
    assert SamplingDefaults.from_folder(folder) == SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40)


def test_an_unreadable_generation_config_falls_back_to_openai_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    assert SamplingDefaults.from_folder(tmp_path) == SamplingDefaults()


def test_the_default_model_carries_its_model_cards_sampling_advice() -> None:
    assert DEFAULT_MODEL_SAMPLING == {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
