"""The default model requantized to Q4_K_M by llama.cpp, served packed: its log-likelihood of a paragraph is llama.cpp's.

Slow (the real default model, and llama.cpp's ``llama_model_quantize`` once into
``~/.cache/meshnet/bench``), and only where llama-cpp-python is installed (``make
llama-cpp``). The file holds Q4_K, Q5_0, Q6_K and Q8_0 matrices (576-wide rows fall back
from the K-quants); ``benchmarks/loglik.py`` is the measurement, this the check of its goal:
meshnet's mean log-likelihood within 1% of llama.cpp's on the same file (issue 35), with float32 and with int8
activations, and int8 within 0.5% of float32 on the same weights (issue 38).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from benchmarks.loglik import ACTIVATIONS_GOAL, GOAL, llama_loglik, meshnet_loglik, q4_k_m
from benchmarks.prompts import FILLER
from services.node.model.model_source import resolve_model
from services.node.model.quant.gguf_file import read_index

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed (make llama-cpp)")]


def test_a_q4_k_m_file_scores_a_paragraph_within_one_percent_of_llama_cpp() -> None:
    model = resolve_model("default")
    assert model.gguf is not None
    gguf = q4_k_m(model.gguf)
    tensors, _ = read_index(gguf)
    assert {"Q4_K", "Q5_0", "Q6_K"} <= {t.kind for t in tensors.values()}
    ids = AutoTokenizer.from_pretrained(model.path)(FILLER.strip())["input_ids"]
    layers = AutoConfig.from_pretrained(model.path).num_hidden_layers
    with torch.inference_mode():
        means, served = meshnet_loglik(model.path, gguf, ids, layers, ("float32", "int8"))
    assert served.startswith("int8")  # packed, each type as it is, not float
    llama = llama_loglik(gguf, ids, torch.get_num_threads())
    for mesh in means.values():  # float32 rows and (where the kernel has them) int8 rows
        assert abs(mesh - llama) <= GOAL * abs(llama), (means, llama)
    if "int8" in means:  # issue 38: int8 activations within 0.5% of float32 activations on the same weights
        assert abs(means["int8"] - means["float32"]) <= ACTIVATIONS_GOAL * abs(means["float32"]), means
