"""A prepared GPU check of the node: real node processes on CUDA in bfloat16.

Run on a machine with a CUDA GPU (`python scripts/gpu_node_check.py --device cuda`):

1. builds the tiny test model, starts two node processes splitting it
   (`--device auto`, `--dtype auto`: they must pick the GPU and bfloat16),
   chats through the head along a signed route, and compares the tokens with
   single-process transformers `generate` on the same GPU and dtype (greedy);
2. builds a SmolLM2-135M-shaped model with random weights (the real weights
   are not needed to time a step), starts it as one node and as two nodes, and
   measures decode ms/token through the OpenAI API against single-process
   `generate` on the GPU in bfloat16.

It prints one JSON object with everything it measured. With `--device cpu` it
runs the same steps on the CPU (a dry run of the script itself).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshwire.routes import Route, RouteNode, sign_route
from tests.procs import TEST_ROUTE_KEY, node_hop_key, pinned_node_env, start_together
from tests.tiny_model import build_tiny_model

log = logging.getLogger("gpu_node_check")
SMOLLM_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}
DECODE_TOKENS = 64
PROMPT = [{"role": "user", "content": "Tell me about the river and the mountains."}]


def build_smollm_shaped(tiny: Path, dest: Path) -> Path:
    """A SmolLM2-135M-shaped Llama (30 layers, hidden 576) with random weights and the tiny model's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    # The tiny tokenizer's vocabulary (so every id decodes); SmolLM2's 49,152 would add 20% to the LM head.
    config = LlamaConfig(**SMOLLM_SHAPE, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def node_env(model: Path, layers: str, device: str, dtype: str, node_id: str) -> dict[str, str]:
    return {"MESHNET_MODEL": str(model), "MESHNET_LAYERS": layers, "MESHNET_DEVICE": device, "MESHNET_DTYPE": dtype,
            "MESHNET_NODE_ID": node_id, "MESHNET_KV_BUDGET_TOKENS": "65536", **pinned_node_env(node_id)}


def signed_route(model_id: str, nodes: list, ranges: list[tuple[int, int]], num_layers: int) -> str:
    hops = tuple(RouteNode(node_id=f"n{i}", endpoint=node.url, shard_start=a, shard_end=b, start_layer=a,
                           hop_key=node_hop_key(f"n{i}").public_text)
                 for i, (node, (a, b)) in enumerate(zip(nodes, ranges)))
    return sign_route(Route(model=model_id, nodes=hops, num_layers=num_layers), TEST_ROUTE_KEY)


def chat(head_url: str, token: str, max_tokens: int, model: str) -> tuple[str, dict, float]:
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, first, last = [], {}, None, None
    with httpx.stream("POST", f"{head_url}/v1/chat/completions", json=body, timeout=300,
                      headers={"X-Meshnet-Route": token}) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(choice["delta"]["content"])
    tokens = usage.get("completion_tokens", 0)
    ms = (last - first) / max(1, tokens - 1) * 1000 if first and last and tokens > 1 else float("nan")
    return "".join(text), usage, ms


def reference(model_dir: Path, device: str, dtype: torch.dtype, max_tokens: int, *, exact_length: bool = False
              ) -> tuple[str, float]:
    """Greedy single-process generate: its text and ms per token (`exact_length` forbids an early EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.to(device) for k, v in ids.items()}
    with torch.inference_mode():
        model.generate(**ids, do_sample=False, max_new_tokens=4)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        began = time.perf_counter()
        out = model.generate(**ids, do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens if exact_length else 0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - began
    new = out[0, ids["input_ids"].shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True), elapsed / len(new) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    report: dict[str, object] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    dtype_name = "bfloat16" if args.device.startswith("cuda") else "float32"
    dtype = getattr(torch, dtype_name)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny-model")
        ranges = [(0, 1), (2, 3)]
        nodes = start_together([("node", node_env(tiny, f"{a}-{b}", "auto" if args.device.startswith("cuda")
                                                  else "cpu", "auto" if args.device.startswith("cuda") else "float32",
                                                  f"n{i}"))
                                for i, (a, b) in enumerate(ranges)])
        try:
            health = httpx.get(f"{nodes[0].url}/health").json()
            report["tiny_head_health"] = health
            token = signed_route(tiny.name, nodes, ranges, 4)
            text, usage, _ = chat(nodes[0].url, token, 48, tiny.name)
            expected, _ = reference(tiny, args.device, dtype, usage["completion_tokens"])
            report["tiny_2_nodes_equal_generate"] = text == expected
            report["tiny_mesh_text"], report["tiny_generate_text"] = text[:80], expected[:80]
        finally:
            for node in nodes:
                node.stop()
        log.info("tiny model check done: %s", report.get("tiny_2_nodes_equal_generate"))

        shaped = build_smollm_shaped(tiny, Path(tmp) / "smollm-shaped")
        _, single_ms = reference(shaped, args.device, dtype, DECODE_TOKENS, exact_length=True)
        report["smollm_shaped_generate_ms_per_token"] = round(single_ms, 2)
        for split in ([(0, 29)], [(0, 14), (15, 29)]):
            nodes = start_together([("node", node_env(shaped, f"{a}-{b}", args.device, dtype_name, f"n{i}"))
                                    for i, (a, b) in enumerate(split)])
            try:
                token = signed_route(shaped.name, nodes, split, 30)
                chat(nodes[0].url, token, 8, shaped.name)  # warm-up
                runs = [chat(nodes[0].url, token, DECODE_TOKENS, shaped.name)[2] for _ in range(3)]
                report[f"smollm_shaped_{len(split)}_nodes_ms_per_token"] = round(min(runs), 2)
            finally:
                for node in nodes:
                    node.stop()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
