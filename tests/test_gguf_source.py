"""``--model FILE.gguf``: the metadata folder, split sets, the file's sampling advice, clear refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, Qwen2Config

from services.node.model.gguf_model import GGUF_MARKER, GgufModelError, check_servable, prepare_gguf_folder
from services.node.model.model_source import ModelSourceError, resolve_model
from services.node.model.quant.quant_load import GgufSource
from services.node.model.shard_load import load_shard
from tests.gguf_mesh import reference, serve_family, shards_generate
from tests.gguf_models import LAYERS, build_gguf_model
from tests.procs import REPO_ROOT, free_port

EXIT_WAIT_S = 120
LOGIT_RTOL = 1e-5
"""Largest difference of the two folders' logits, relative to the largest logit: float32 rounding only."""


def _write_minimal(path: Path, arch: str, kind: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    tensor = np.zeros((4, 32), dtype=np.float32) if kind == gguf.GGMLQuantizationType.F32 \
        else np.zeros((4, 32), dtype=np.int32)
    writer.add_tensor("token_embd.weight", tensor, raw_dtype=None if kind == gguf.GGMLQuantizationType.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_becomes_a_model_folder_once(tmp_path: Path) -> None:
    made = build_gguf_model("llama", tmp_path / "model")
    resolved = resolve_model(str(made.path), cache_dir=tmp_path / "cache")
    assert resolved.gguf == made.path.resolve() and resolved.weights_in_gguf
    assert resolved.model_id == "tiny-llama"
    assert not list(resolved.path.glob("*.safetensors")), "the weights stay in the file"
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert tokenizer.chat_template == made.tokenizer.chat_template
    assert json.loads((resolved.path / "config.json").read_text())["num_hidden_layers"] == LAYERS
    marker = (resolved.path / GGUF_MARKER).stat().st_mtime_ns
    again = resolve_model(str(made.path), cache_dir=tmp_path / "cache")
    assert again.path == resolved.path and (again.path / GGUF_MARKER).stat().st_mtime_ns == marker
    folder = resolve_model(str(resolved.path), cache_dir=tmp_path / "cache")  # what `meshnet up` hands its nodes
    assert folder.gguf == made.path.resolve() and folder.model_id == resolved.model_id


def test_the_files_sampling_advice_becomes_the_generation_config(tmp_path: Path) -> None:
    made = build_gguf_model("qwen2", tmp_path / "model")
    reader = gguf.GGUFReader(made.path)
    writer = gguf.GGUFWriter(tmp_path / "advised.gguf", "qwen2")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_float32("general.sampling.top_p", 0.95)
    writer.add_int32("general.sampling.top_k", 20)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = prepare_gguf_folder(tmp_path / "advised.gguf", tmp_path / "cache")
    advice = GenerationConfig.from_pretrained(folder)
    assert advice.do_sample and (advice.temperature, advice.top_k) == (pytest.approx(0.6), 20)
    assert advice.top_p == pytest.approx(0.95)


def test_a_split_gguf_is_named_by_its_first_part_and_answers_as_one_file(tmp_path: Path) -> None:
    whole = serve_family("qwen3", tmp_path / "whole")
    parts = build_gguf_model("qwen3", tmp_path / "split", split_max_tensors=12)
    names = sorted(p.name for p in parts.path.parent.glob("*.gguf"))
    assert len(names) > 2 and parts.path.name == names[0]
    with pytest.raises(ModelSourceError, match="first part"):
        resolve_model(str(parts.path.parent / names[1]), cache_dir=tmp_path / "cache")
    resolved = resolve_model(str(parts.path), cache_dir=tmp_path / "cache")
    assert resolved.model_id == "tiny-qwen3"
    split = whole.__class__(gguf=parts, folder=resolved.path, cache=tmp_path / "cache", tokenizer=whole.tokenizer,
                            prompt=whole.prompt)
    assert shards_generate(split, [(0, 1), (2, LAYERS - 1)]) == reference(whole)


def test_a_shard_holds_only_its_own_layers_of_the_file(tmp_path: Path) -> None:
    served = serve_family("mixtral", tmp_path)
    whole = load_shard(served.folder, 0, LAYERS - 1, torch.float32, torch.device("cpu"))
    middle = load_shard(served.folder, 1, 2, torch.float32, torch.device("cpu"))
    layer = (whole.weight_bytes() - middle.weight_bytes()) / 2  # not exact: the whole shard has embedding and head
    assert middle.weight_bytes() < whole.weight_bytes() / 2
    assert set(middle.modules.state_dict()) == {k for k in whole.modules.state_dict() if ".layers.1." in k
                                                or ".layers.2." in k}
    assert layer > 0


def test_only_llama_family_files_have_their_query_and_key_rows_reordered(tmp_path: Path) -> None:
    path = build_gguf_model("llama", tmp_path).path
    rows = 64
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    qwen = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    order = GgufSource(path, llama)._row_order("model.layers.0.self_attn.q_proj.weight", rows)
    assert order is not None and order.tolist() != list(range(rows))
    assert GgufSource(path, qwen)._row_order("model.layers.0.self_attn.q_proj.weight", rows) is None


def test_an_unserved_architecture_or_tensor_type_is_refused_in_one_line(tmp_path: Path) -> None:
    phi2 = _write_minimal(tmp_path / "phi2.gguf", "phi2")
    with pytest.raises(GgufModelError, match="architecture 'phi2' is not served"):
        check_servable(phi2)
    odd = _write_minimal(tmp_path / "odd.gguf", "llama", gguf.GGMLQuantizationType.I32)
    with pytest.raises(GgufModelError, match="I32"):
        check_servable(odd)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    env["PYTHONPATH"] = f"{REPO_ROOT / 'libs'}{os.pathsep}{REPO_ROOT}"
    done = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--model", str(phi2), "--port",
                           str(free_port())], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=EXIT_WAIT_S, check=False)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "architecture 'phi2' is not served" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_default_models_gguf_served_directly_answers_as_its_converted_folder(tmp_path: Path) -> None:
    from services.node.model.model_source import _locate_default_gguf

    direct = resolve_model(str(_locate_default_gguf()), cache_dir=tmp_path)
    converted = resolve_model("default")  # the folder `make setup` converted (converted now if missing)
    mine, theirs = AutoTokenizer.from_pretrained(direct.path), AutoTokenizer.from_pretrained(converted.path)
    assert mine.chat_template == theirs.chat_template
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    prompt = mine.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    assert prompt.tolist() == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                         return_tensors="pt")["input_ids"].tolist()
    logits = []
    for folder in (direct.path, converted.path):
        shard = load_shard(folder, 0, 29, torch.float32, torch.device("cpu"))
        logits.append(shard.logits_last(shard.run_layers(shard.embed(prompt), shard.new_cache(), 0)))
        del shard
    # The same float32 weights, bit for bit; the products may still round apart in the last place: a BLAS
    # kernel's summation order can depend on where a buffer lies (seen on an AMD EPYC: 5.7e-6 on logits of ~20).
    assert (logits[0] - logits[1]).abs().max() <= LOGIT_RTOL * logits[1].abs().max()
    assert torch.equal(logits[0].topk(10).indices, logits[1].topk(10).indices)
