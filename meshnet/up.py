"""`meshnet up`: a whole mesh on this machine, for trying meshnet in one command.

It prepares the model once (the default model is converted from its GGUF on
first use, with progress), then starts the tracker, the relay, the bootstrap
registry and N nodes, each as its own process, exactly as they would run on
separate machines. The nodes start without ``--layers``: the tracker places
each within its ``--max-memory`` (given, else its share of the memory found
free: N nodes on one machine share it), covering the model first and then
replicating its slowest stage, and heals the mesh when one stops. With
``--prefill-nodes`` the decode and prefill nodes still split the layers evenly
(``--layers``): a prefill/decode handoff needs both sides' layouts fixed. When
every node has joined and the tracker lists the model with a complete route it
prints where each node was placed, the base URL and how to use it. Ctrl-C stops
every process cleanly (SIGTERM, then SIGKILL after a grace).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from meshwire import exposure
from meshwire.auth import DEFAULT_SECRET

log = logging.getLogger("meshnet.up")

READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0
POLL_S = 0.25
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_NODES = 64


class UpSettings(BaseSettings):
    """What `meshnet up` starts."""

    model_config = SettingsConfigDict(env_prefix="MESHNET_", extra="ignore", frozen=True)

    model: str = Field(DEFAULT_MODEL, description="a local model folder, a GGUF file or a model name")
    nodes: int = Field(2, ge=1, le=MAX_NODES, description="how many nodes the tracker places on the model's layers")
    max_memory: str | None = Field(None, max_length=32, description="each node's memory budget for weights and KV "
                                   "(80MB, 6GiB); default: its share of the memory found free")
    prefill_nodes: int = Field(0, ge=0, le=MAX_NODES, description="prefill nodes (--role prefill) splitting the "
                                                                   "layers beside the others, which then decode; "
                                                                   "0: none")
    port: int = Field(8000, ge=1, le=65535, description="the tracker's port (the OpenAI base URL)")
    dtype: str = Field("auto", description="auto, float32, bfloat16 or float16")
    device: str = Field("auto", description="auto, cpu or cuda[:N]")
    host: str = Field("127.0.0.1", description="the address every service listens on")
    relay_port: int = Field(8001, ge=1, le=65535, description="the relay's port")
    bootstrap_port: int = Field(8002, ge=1, le=65535, description="the bootstrap registry's port")
    node_port: int = Field(8100, ge=1, le=65535, description="the first node's port; the others follow")
    secret: str = Field(DEFAULT_SECRET, description="the mesh's shared secret (the default is refused off loopback)")


@dataclass
class Child:
    """One service process of the local mesh."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]


def split_layers(num_layers: int, nodes: int) -> list[tuple[int, int]]:
    """Contiguous inclusive ranges, as even as possible, earlier nodes taking the remainder."""
    if not 1 <= nodes <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {nodes} nodes")
    base, extra = divmod(num_layers, nodes)
    ranges, start = [], 0
    for index in range(nodes):
        size = base + (1 if index < extra else 0)
        ranges.append((start, start + size - 1))
        start += size
    return ranges


def node_budget(settings: UpSettings) -> str:
    """Each placed node's ``--max-memory``: the one given, else an equal share of the memory found free."""
    if settings.max_memory:
        return settings.max_memory
    from services.node.model.device import pick_device  # the CLI may use service code; services may not
    from services.node.model.memory_budget import default_budget_bytes

    return str(max(1, default_budget_bytes(pick_device(settings.device)) // settings.nodes))


def placed_nodes_text(base: str) -> str:
    """Where the tracker placed each node, a line each (for the banner)."""
    nodes = httpx.get(f"{base}/v1/nodes", timeout=2.0).json().get("nodes") or []
    return "".join(f"  {n['node_id']}: layers {n['shard_start']}-{n['shard_end']} ({n.get('placement') or 'pinned'}, "
                   f"{n.get('weight_bytes', 0) / 1e6:.1f} MB of weights)\n"
                   for n in sorted(nodes, key=lambda n: (n["shard_start"], n["node_id"])) if n.get("routable"))


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _prepare_model(settings: UpSettings) -> tuple[str, int]:
    """Resolve (and on first use convert) the model; answer its id and layer count."""
    from services.node.model.model_source import (
        resolve_model,  # the CLI may use service code; services may not
    )

    log.info("preparing model %s", settings.model)
    resolved = resolve_model(settings.model)
    config = json.loads((Path(resolved.path) / "config.json").read_text())
    num_layers = int(config["num_hidden_layers"])
    log.info("model %s ready at %s: %d layers", resolved.model_id, resolved.path, num_layers)
    return str(resolved.path), num_layers


def _spawn(name: str, args: list[str], env: dict[str, str], url: str, log_level: str) -> Child:
    cmd = [sys.executable, "-m", "meshnet.cli", "--log-level", log_level, *args]
    log.info("starting %s at %s", name, url)
    return Child(name=name, url=url, proc=subprocess.Popen(cmd, env=env))


def _wait(children: list[Child], ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for child in children:
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} while waiting for {what}")
        with contextlib.suppress(httpx.HTTPError):
            if ready():
                return
        time.sleep(POLL_S)
    raise TimeoutError(f"timed out waiting for {what}")


def _healthy(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=2.0).status_code == 200


def _stop(children: list[Child]) -> None:
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in reversed(children):
        remaining = max(0.1, deadline - time.monotonic())
        try:
            child.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", child.name, STOP_GRACE_S)
            child.proc.kill()
            child.proc.wait()


def usage_banner(base_url: str, model: str) -> str:
    """What the user sees once the mesh answers: the URL and a three-line SDK example."""
    return (
        f"\nmeshnet is up: OpenAI-compatible API at {base_url}/v1  (model: {model})\n\n"
        f"    from openai import OpenAI\n"
        f"    client = OpenAI(base_url=\"{base_url}/v1\", api_key=\"unused\")\n"
        f"    print(client.chat.completions.create(model=\"{model}\", "
        f"messages=[{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]).choices[0].message.content)\n\n"
        f"or: meshnet chat --url {base_url} \"What is the capital of France?\"\n"
        f"mesh page: {base_url}/    nodes: {base_url}/v1/nodes    Ctrl-C stops everything.\n"
    )


def run_up(settings: UpSettings, log_level: str = "info") -> int:
    """Start the mesh, wait until it serves, then until Ctrl-C. Answers the exit code."""
    try:
        exposure.require_private_secret("meshnet up", settings.host, settings.secret)
    except exposure.UnsafeSecret as exc:
        print(f"meshnet up: {exc}", file=sys.stderr)
        return 2
    node_ports = [settings.node_port + i for i in range(settings.nodes + settings.prefill_nodes)]
    wanted = {"--port": settings.port, "--relay-port": settings.relay_port,
              "--bootstrap-port": settings.bootstrap_port, **{f"node {i}": p for i, p in enumerate(node_ports)}}
    taken = [f"{what} {port}" for what, port in wanted.items() if not _port_free(settings.host, port)]
    if taken:
        print(f"meshnet up: port(s) already in use: {', '.join(taken)}; choose others with the flags "
              f"(--port, --relay-port, --bootstrap-port, --node-port)", file=sys.stderr)
        return 2

    if settings.max_memory:
        from services.node.settings import parse_size

        try:
            parse_size(settings.max_memory)
        except ValueError as exc:
            print(f"meshnet up: --max-memory: {exc}", file=sys.stderr)
            return 2
    _, num_layers = _prepare_model(settings)
    if settings.prefill_nodes and max(settings.nodes, settings.prefill_nodes) > num_layers:
        print(f"meshnet up: {max(settings.nodes, settings.prefill_nodes)} nodes cannot split {num_layers} layers",
              file=sys.stderr)
        return 2

    host = settings.host
    base = f"http://{host}:{settings.port}"
    env = {**os.environ, "MESHNET_SECRET": settings.secret, "TOKENIZERS_PARALLELISM": "false"}
    children: list[Child] = []
    interrupted = False
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Ctrl-C stops the mesh even when this process was started with SIGINT ignored (a shell starts background
    # jobs so, and Python then never turns SIGINT into KeyboardInterrupt): `kill -INT` must stop it too.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        children.append(_spawn("tracker", ["tracker", "--host", host, "--port", str(settings.port)], env, base,
                               log_level))
        relay_url = f"http://{host}:{settings.relay_port}"
        children.append(_spawn("relay", ["relay", "--host", host, "--port", str(settings.relay_port),
                                         "--tracker", base], env,
                               relay_url, log_level))
        boot_url = f"http://{host}:{settings.bootstrap_port}"
        registry = ["--registry", "cache-layouts"] if settings.prefill_nodes else []
        children.append(_spawn("bootstrap", ["bootstrap", "--host", host, "--port", str(settings.bootstrap_port),
                                             "--no-access-log", *registry],
                               env, boot_url, log_level))
        _wait(children, lambda: all(_healthy(c.url) for c in children), "the tracker, relay and bootstrap")
        pd = ["--bootstrap", boot_url] if settings.prefill_nodes else []
        plan: list[tuple[str, tuple[int, int] | None, list[str]]]
        if settings.prefill_nodes:
            plan = [(f"node-{i}", r, ["--role", "decode", *pd]) for i, r in enumerate(split_layers(num_layers,
                                                                                                  settings.nodes))]
            plan += [(f"prefill-{i}", r, ["--role", "prefill", *pd])
                     for i, r in enumerate(split_layers(num_layers, settings.prefill_nodes))]
        else:  # placed by the tracker within their budgets
            budget = node_budget(settings)
            log.info("nodes start without --layers: the tracker places each within --max-memory %s", budget)
            plan = [(f"node-{i}", None, ["--max-memory", budget]) for i in range(settings.nodes)]
        for (name, layers, extra), port in zip(plan, node_ports, strict=True):
            pinned = ["--layers", f"{layers[0]}-{layers[1]}"] if layers is not None else []
            args = ["node", "--model", settings.model, *pinned, "--tracker", base,
                    "--host", host, "--port", str(port), "--dtype", settings.dtype, "--device", settings.device,
                    "--node-id", name, *extra]
            where = f"layers {layers[0]}-{layers[1]}" if layers is not None else "placed by the tracker"
            children.append(_spawn(f"{name} ({where})", args, env, f"http://{host}:{port}", log_level))

        def model_listed() -> bool:
            models = httpx.get(f"{base}/v1/models", timeout=2.0).json().get("data") or []
            nodes = httpx.get(f"{base}/v1/nodes", timeout=2.0).json().get("nodes") or []
            return bool(models) and sum(1 for n in nodes if n.get("routable")) >= len(plan)

        _wait(children, model_listed, "every node to load its layers and join")
        model_id = httpx.get(f"{base}/v1/models", timeout=2.0).json()["data"][0]["id"]
        print(f"\nthe nodes hold:\n{placed_nodes_text(base)}" + usage_banner(base, model_id), flush=True)
        while all(child.proc.poll() is None for child in children):
            time.sleep(POLL_S)
        dead = [c.name for c in children if c.proc.poll() is not None]
        print(f"meshnet up: {', '.join(dead)} stopped; stopping the mesh", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        interrupted = True
        print("\nmeshnet up: stopping the mesh...", file=sys.stderr)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"meshnet up: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        _stop(children)
        if interrupted:
            print("meshnet up: stopped.", file=sys.stderr)
