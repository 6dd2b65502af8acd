"""``--model`` resolves to a usable safetensors folder: local folders as they are, the default model converted once."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import filelock
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.node.head.sampling_defaults import SamplingDefaults
from services.node.model.model_source import (
    DEFAULT_MODEL,
    SOURCE_MARKER,
    ModelSourceError,
    ResolvedModel,
    conversion_lock,
    has_chat_template,
    resolve_model,
)
from services.node.model.shard_load import load_shard

CPU = torch.device("cpu")


def copy_model(source: Path, dest: Path, *, without: tuple[str, ...] = ()) -> Path:
    dest.mkdir()
    for item in source.iterdir():
        if item.name not in without:
            shutil.copy(item, dest / item.name)
    return dest


def test_a_local_model_folder_is_used_where_it_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    resolved = resolve_model(str(tiny_model_dir), tmp_path / "cache")

    assert resolved == ResolvedModel(path=tiny_model_dir.resolve(), model_id=tiny_model_dir.name)
    assert not (tmp_path / "cache").exists(), "a local folder needs no cache"


def test_a_folder_without_config_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m", without=("config.json",))
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_model(str(folder), tmp_path)


def test_a_folder_with_only_pytorch_bin_weights_is_refused_with_a_hint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m", without=("model.safetensors",))
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="no .safetensors weights.*save them as safetensors"):
        resolve_model(str(folder), tmp_path)


def test_a_folder_without_tokenizer_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m", without=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ModelSourceError, match="no tokenizer"):
        resolve_model(str(folder), tmp_path)


def test_a_folder_without_chat_template_loads_with_a_warning(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = copy_model(tiny_model_dir, tmp_path / "m", without=("chat_template.jinja",))
    with caplog.at_level(logging.WARNING):
        resolved = resolve_model(str(folder), tmp_path)

    assert resolved.path == folder.resolve()
    assert not has_chat_template(folder) and has_chat_template(tiny_model_dir)
    assert "no chat template" in caplog.text


@pytest.mark.parametrize("name", ["", "   ", "not a model", "a/b/c", "../nowhere"])
def test_a_name_that_is_neither_a_folder_nor_a_hub_name_is_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError):
        resolve_model(name, tmp_path)


@pytest.mark.slow
def test_the_default_model_is_converted_once_and_its_shards_match_generate(tmp_path: Path) -> None:
    reports: list[tuple[str, float]] = []
    resolved = resolve_model("default", tmp_path, progress=lambda stage, done: reports.append((stage, done)))

    assert resolved.model_id == DEFAULT_MODEL
    assert has_chat_template(resolved.path)
    assert SamplingDefaults.from_folder(resolved.path) == SamplingDefaults(temperature=0.2, top_p=0.9)
    assert any("writing safetensors" in stage for stage, _ in reports)
    assert reports[-1][1] == 1.0
    assert [done for _, done in reports] == sorted(done for _, done in reports)

    # A second start finds the converted folder and reports no work.
    weights = resolved.path / "model.safetensors"
    written = weights.stat().st_mtime_ns
    quiet: list[tuple[str, float]] = []
    assert (
        resolve_model("SmolLM2-135M-Instruct", tmp_path, progress=lambda s, d: quiet.append((s, d)))
        == resolved
    )
    assert quiet == [] and weights.stat().st_mtime_ns == written

    # A node started while another converts waits for it instead of converting again.
    marker = resolved.path / SOURCE_MARKER
    source = marker.read_text()
    marker.unlink()
    waiting: list[str] = []
    results: list[ResolvedModel] = []
    lock = filelock.FileLock(str(conversion_lock(resolved.path)))
    with lock:
        waiter = threading.Thread(
            target=lambda: results.append(
                resolve_model(DEFAULT_MODEL, tmp_path, lambda s, d: waiting.append(s))
            )
        )
        waiter.start()
        deadline = time.monotonic() + 30
        while not any("waiting for another process" in s for s in waiting) and time.monotonic() < deadline:
            time.sleep(0.1)
        marker.write_text(source)  # the other process finishes its conversion
    waiter.join(timeout=60)
    assert results == [resolved]
    assert any("waiting for another process" in s for s in waiting)
    assert not any("writing safetensors" in s for s in waiting)
    assert weights.stat().st_mtime_ns == written

    # Two shards of the converted model (the tail's LM head tied to the embedding) equal generate.
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}],
        add_generation_prompt=True,
        return_tensors="pt",
    )["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    expected = reference.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20
    )
    expected_tokens = expected[0, prompt.shape[1] :].tolist()
    del reference

    head = load_shard(resolved.path, 0, 14, torch.float32, CPU)
    tail = load_shard(resolved.path, 15, 29, torch.float32, CPU)
    caches = (head.new_cache(), tail.new_cache())
    tokens: list[int] = []
    step, position = prompt, 0
    while len(tokens) < len(expected_tokens):
        hidden = tail.run_layers(head.run_layers(head.embed(step), caches[0], position), caches[1], position)
        position += step.shape[1]
        tokens.append(int(tail.logits_last(hidden).argmax()))
        step = torch.tensor([[tokens[-1]]])

    assert tokens == expected_tokens
    assert len(expected_tokens) >= 5
