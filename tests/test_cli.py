"""The `meshnet` command line as a new user meets it: help, `meshnet up`, `meshnet chat`, Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.procs import REPO_ROOT, free_port, free_ports_in_a_row, service_env

MESHNET = [sys.executable, "-m", "meshnet.cli"]
UP_READY_TIMEOUT_S = 180.0
UP_STOP_TIMEOUT_S = 60.0
"""How long `meshnet up` may take to stop its processes (each gets a grace of 10 s, then SIGKILL)."""
UP_BUDGET = "1100KB"
"""Each node's --max-memory: two layers of the tiny model with the embedding or the LM head, so the tracker
places two nodes on layers 0-1 and 2-3."""


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MESHNET, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False)


def test_help_lists_every_command() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("up", "tracker", "node", "relay", "bootstrap", "chat"):
        assert command in result.stdout


def test_node_help_names_each_flag_with_its_environment_twin() -> None:
    result = run_cli("node", "--help")
    assert result.returncode == 0
    for flag, env in (("--model", "MESHNET_MODEL"), ("--layers", "MESHNET_LAYERS"), ("--tracker", "MESHNET_TRACKER"),
                      ("--relay", "MESHNET_RELAY"), ("--dtype", "MESHNET_DTYPE"), ("--device", "MESHNET_DEVICE")):
        assert flag in result.stdout and env in result.stdout


def test_bootstrap_help_offers_both_registries() -> None:
    result = run_cli("bootstrap", "--help")
    assert "addresses" in result.stdout and "cache-layouts" in result.stdout


class UpProcess:
    """`meshnet up` running in the background, its output collected line by line."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([*MESHNET, "up", *args], cwd=REPO_ROOT, env=service_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.output():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"`meshnet up` never printed {text!r}:\n{self.output()}")


def stop_up(up: UpProcess) -> None:
    """Stop ``meshnet up`` as Ctrl-C does (SIGTERM: it stops every process it started), killing it only if it
    hangs; a SIGKILL alone would leave its nodes running."""
    if up.proc.poll() is None:
        up.proc.terminate()
        try:
            up.proc.wait(timeout=UP_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            up.proc.kill()
            up.proc.wait()


@pytest.fixture(scope="module")
def local_mesh(tiny_model_dir: Path):
    ports = [free_port() for _ in range(3)] + [free_ports_in_a_row(2)]  # both nodes' ports must be free
    up = UpProcess(["--model", str(tiny_model_dir), "--nodes", "2", "--dtype", "float32", "--max-memory", UP_BUDGET,
                    "--port", str(ports[0]), "--relay-port", str(ports[1]), "--bootstrap-port", str(ports[2]),
                    "--node-port", str(ports[3])])
    try:
        up.wait_for("meshnet is up", UP_READY_TIMEOUT_S)
        yield up, f"http://127.0.0.1:{ports[0]}"
    finally:
        stop_up(up)


def test_up_starts_its_nodes_without_layers_and_the_tracker_places_them(local_mesh) -> None:
    up, base = local_mesh
    nodes = httpx.get(f"{base}/v1/nodes").json()["nodes"]
    assert sorted((n["shard_start"], n["shard_end"], n["placement"]) for n in nodes) == [
        (0, 1, "covering"), (2, 3, "covering")]
    assert "the nodes hold:" in up.output() and "layers 0-1 (covering" in up.output()


def test_up_prints_the_base_url_and_an_openai_example(local_mesh) -> None:
    up, base = local_mesh
    assert f"{base}/v1" in up.output()
    assert "from openai import OpenAI" in up.output()


def test_the_openai_sdk_answers_against_the_printed_url(local_mesh) -> None:
    _, base = local_mesh
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=8, temperature=0)
    assert answer.usage is not None and answer.usage.completion_tokens >= 1


def test_chat_streams_an_answer_to_the_terminal(local_mesh) -> None:
    _, base = local_mesh
    result = run_cli("chat", "--url", base, "--max-tokens", "8", "hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() != ""


def test_ctrl_c_stops_every_process_of_the_mesh(local_mesh) -> None:
    up, base = local_mesh
    up.proc.send_signal(signal.SIGINT)
    try:
        code = up.proc.wait(timeout=UP_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"meshnet up did not stop in {UP_STOP_TIMEOUT_S:.0f} s after Ctrl-C; its output:\n{up.output()}")
    assert code == 0, up.output()
    up.reader.join(timeout=5)
    assert "stopped" in up.output()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{base}/health", timeout=2)


def test_chat_against_no_mesh_says_it_cannot_reach_it() -> None:
    result = run_cli("chat", "--url", f"http://127.0.0.1:{free_port()}", "hello")
    assert result.returncode == 1
    assert "cannot reach" in result.stderr


def test_up_with_prefill_nodes_wires_them_to_the_bootstrap_registry_and_long_prompts_use_them(
        tiny_model_dir: Path) -> None:
    ports = [free_port() for _ in range(3)] + [free_ports_in_a_row(2)]
    up = UpProcess(["--model", str(tiny_model_dir), "--nodes", "1", "--prefill-nodes", "1", "--dtype", "float32",
                    "--port", str(ports[0]), "--relay-port", str(ports[1]), "--bootstrap-port", str(ports[2]),
                    "--node-port", str(ports[3])])
    base, auth = f"http://127.0.0.1:{ports[0]}", {"Authorization": "Bearer meshnet-dev-secret"}
    try:
        up.wait_for("meshnet is up", UP_READY_TIMEOUT_S)
        deadline = time.monotonic() + UP_READY_TIMEOUT_S
        nodes: dict[str, dict[str, object]] = {}
        while time.monotonic() < deadline:
            nodes = {n["node_id"]: n for n in httpx.get(f"{base}/v1/nodes", headers=auth).json()["nodes"]}
            if nodes.get("prefill-0", {}).get("pd_rank") == 0:
                break
            time.sleep(0.5)
        assert {name: node["role"] for name, node in nodes.items()} == {"node-0": "decode", "prefill-0": "prefill"}
        assert nodes["prefill-0"]["pd_rank"] == 0
        sizes = httpx.get(f"http://127.0.0.1:{ports[2]}/route", params={"engine_rank": -1, "target_dp_group": -1})
        assert sizes.json()["prefill_pp_size"] == 1 and sizes.json()["cache_layout"]
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        long = "the river and the mill " * 60  # over the tracker's default 256 prompt tokens
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}],
                                                max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
        metrics = httpx.get(str(nodes["node-0"]["endpoint"]) + "/metrics").text
        assert 'meshnet_node_pd_requests_total{outcome="handoff"} 1.0' in metrics
    finally:
        stop_up(up)
