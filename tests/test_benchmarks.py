"""The benchmark harness's own logic, without timing anything (no test here asserts a speed).

Run with ``.venv/bin/python -m pytest benchmarks/test_harness.py``; it belongs
in ``tests/`` (as ``tests/test_benchmarks.py``) once the lead moves it there.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.load import hammer
from benchmarks.machine import describe_machine
from benchmarks.mesh import MeshSpec, split_layers
from benchmarks.prompts import messages_of_length, prompt_token_ids
from benchmarks.quiet import save_result
from benchmarks.results import Outcome, Result, Row, load_results, write_result
from benchmarks.rounds import interleave
from benchmarks.run import command_for, parse_args
from benchmarks.stats import ratio, spread
from benchmarks.timing import StreamTiming, TooFewTokens


def test_a_spread_is_the_median_and_range_of_its_samples() -> None:
    value = spread([3.0, 1.0, 2.0, 10.0])
    assert (value.median, value.min, value.max, value.n) == (2.5, 1.0, 10.0, 4)
    assert value.short(1) == "2.5 (1.0–10.0, n=4)"


def test_a_spread_needs_a_sample_and_a_ratio_a_positive_baseline() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        spread([])
    with pytest.raises(ValueError, match="non-positive"):
        ratio(spread([1.0]), 0.0)
    assert ratio(spread([2.0, 4.0]), 2.0).samples == (1.0, 2.0)


def test_decode_rate_leaves_out_the_first_token_and_refuses_a_single_token() -> None:
    timing = StreamTiming(tokens=11, first_s=0.5, last_s=1.5)
    assert timing.tokens_per_s == pytest.approx(10.0)
    assert timing.ms_per_token == pytest.approx(100.0)
    with pytest.raises(TooFewTokens):
        _ = StreamTiming(tokens=1, first_s=0.5, last_s=0.5).tokens_per_s


def test_interleaved_rounds_rotate_the_order_and_keep_each_contenders_results() -> None:
    calls: list[str] = []

    def contender(name: str) -> str:
        calls.append(name)
        return name.upper()

    results = interleave({name: (lambda n=name: contender(n)) for name in "abc"}, 3, log=lambda _: None,
                         describe=str)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert results == {"a": ["A"] * 3, "b": ["B"] * 3, "c": ["C"] * 3}
    with pytest.raises(ValueError):
        interleave({"a": lambda: 1}, 0, log=lambda _: None, describe=str)


@pytest.mark.parametrize(("layers", "parts"), [(30, 1), (30, 2), (30, 3), (30, 4), (4, 4), (7, 3)])
def test_layers_are_split_into_contiguous_ranges_that_cover_the_model(layers: int, parts: int) -> None:
    ranges = split_layers(layers, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == layers - 1
    assert all(after[0] == before[1] + 1 for before, after in itertools.pairwise(ranges))
    sizes = [end - start + 1 for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_a_mesh_cannot_have_more_nodes_than_layers_or_relay_a_node_it_lacks() -> None:
    with pytest.raises(ValueError):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="nodes"):
        MeshSpec(model="m", num_layers=4, nodes=5)
    with pytest.raises(ValueError, match="relayed"):
        MeshSpec(model="m", num_layers=4, nodes=2, relayed=frozenset({2}))


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from tests.tiny_model import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("target", [64, 300, 1000])
def test_a_prompt_of_a_given_length_is_as_long_as_possible_without_exceeding_it(tiny_tokenizer, target: int) -> None:  # type: ignore[no-untyped-def]
    messages, length = messages_of_length(tiny_tokenizer, target)
    assert length == len(prompt_token_ids(tiny_tokenizer, messages)) <= target
    assert length >= target * 0.95


def test_the_readme_section_between_the_markers_is_replaced_and_the_rest_kept() -> None:
    text = f"intro\n{report.BEGIN}\nold table\n{report.END}\noutro\n"
    replaced = report.replace_section(text, "new table")
    assert replaced.startswith("intro\n") and replaced.endswith(f"{report.END}\noutro\n")
    assert "new table" in replaced and "old table" not in replaced
    with pytest.raises(report.MarkersMissing):
        report.replace_section("no markers here", "table")


def test_a_written_result_reads_back_and_its_rows_reach_the_table_with_their_command(tmp_path: Path) -> None:
    result = Result(benchmark="hops", title="t", command=command_for("hops", quick=True), quick=True,
                    started_at=dt.datetime.now(dt.UTC).isoformat(), elapsed_s=1.0, machine=describe_machine(),
                    outcome=Outcome(rows=(Row(label="tiny model, 2 nodes", value=spread([4.0, 5.0]),
                                              unit="ms/token", note="a | note"),)), other_cores=0.0)
    write_result(result, tmp_path)
    assert load_results(tmp_path) == [result]
    table = report.render_section(load_results(tmp_path))
    assert "| hops (quick) | tiny model, 2 nodes | 4.5 ms/token | 4.0–5.0 | 2 | a \\| note |" in table
    assert "`.venv/bin/python -m benchmarks.run --only hops --quick`" in table


def _result_under_load(others: float | None, started_at: str = "2026-12-03T00:00:00+00:00") -> Result:
    machine = describe_machine().model_copy(update={"load_average_1m": 0.0})
    return Result(benchmark="decode", title="t", command=command_for("decode", quick=False), quick=False,
                  started_at=started_at, elapsed_s=1.0, machine=machine, other_cores=others,
                  outcome=Outcome(rows=(Row(label="mesh", value=spread([10.0]), unit="tok/s", note="goal"),)))


def test_a_loaded_run_is_marked_in_the_table_and_a_quiet_one_is_not(tmp_path: Path) -> None:
    loaded = report.render_section([_result_under_load(1.5)])
    assert "| goal; loaded machine (other work used 1.5 cores on average) |" in loaded
    assert "other work 1.50 cores" in loaded
    assert "loaded machine" not in report.render_section([_result_under_load(0.1)])
    assert "loaded machine" not in report.render_section([_result_under_load(None)])  # older results: start load


def test_other_work_is_the_machines_busy_time_less_this_runs_own_children_included() -> None:
    import subprocess
    import sys

    from benchmarks import quiet

    assert quiet.other_cores(busy_s=30.0, own_s=20.0, elapsed_s=10.0) == 1.0
    assert quiet.other_cores(busy_s=19.0, own_s=20.0, elapsed_s=10.0) == 0.0  # ticks rounding: never negative
    assert quiet.other_cores(busy_s=1.0, own_s=0.0, elapsed_s=0.0) is None
    before = quiet._own_seconds()
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert quiet._own_seconds() - before >= 0.45  # a reaped child's CPU (a stopped mesh's) is this run's own


def test_a_loaded_run_never_replaces_a_quiet_result_unless_asked(tmp_path: Path) -> None:
    quiet, loaded = _result_under_load(0.1, "quiet"), _result_under_load(1.8, "loaded")
    save_result(quiet, tmp_path)
    aside = save_result(loaded, tmp_path)
    assert aside.name == "decode.loaded.json" and load_results(tmp_path) == [quiet]
    save_result(loaded, tmp_path, replace_quiet=True)
    assert load_results(tmp_path) == [loaded]
    newer_quiet = _result_under_load(0.0, "newer quiet")
    save_result(newer_quiet, tmp_path)  # a quiet run replaces a loaded one, and a loaded one a loaded one
    assert load_results(tmp_path) == [newer_quiet]


def test_only_names_known_benchmarks_and_keeps_the_documented_order() -> None:
    assert parse_args(["--only", "relay,decode"]).only == ("decode", "relay")
    with pytest.raises(SystemExit):
        parse_args(["--only", "decode,warp-speed"])


class _OkOrNotFound(BaseHTTPRequestHandler):
    """200 for ``/ok``, 404 for anything else, on a keep-alive HTTP/1.1 connection."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        status, body = (200, b"yes") if self.path == "/ok" else (404, b"no such path")
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return None


@pytest.fixture
def http_server() -> Iterator[tuple[str, int]]:
    """A real HTTP/1.1 server on an ephemeral port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OkOrNotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield "127.0.0.1", server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_the_load_generator_counts_answers_and_never_takes_a_refusal_for_throughput(http_server) -> None:  # type: ignore[no-untyped-def]
    host, port = http_server
    good = asyncio.run(hammer(host, port, ["/ok"], concurrency=2, duration_s=0.2))
    assert good.ok > 0 and good.refused == 0
    mixed = asyncio.run(hammer(host, port, ["/ok", "/missing"], concurrency=1, duration_s=0.2))
    assert mixed.refused > 0 and mixed.first_refusal is not None and mixed.first_refusal.startswith("404")
