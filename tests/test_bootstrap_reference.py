"""The reference server's three tests (``reference/bootstrap.rs.txt``), ported against a real server."""

from __future__ import annotations

import json

import httpx
import pytest

from services.bootstrap.layout import CacheLayout
from services.bootstrap.server import BindError, BootstrapServer
from services.bootstrap.settings import BootstrapSettings
from tests.bootstrap_samples import STAGES, cache_registration, layout, registration

TIMEOUT_S = 5.0
SIZES = "/route?engine_rank=-1&target_dp_group=-1"


def start(registry: str = "addresses") -> BootstrapServer:
    return BootstrapServer(BootstrapSettings(host="127.0.0.1", port=0, registry=registry,
                                             access_log=False)).start()


def test_source_ranks_register_and_are_looked_up() -> None:
    server = start()
    try:
        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
            assert http.get("/health").text == "OK"
            for rank, port in [(0, 7000), (3, 7003)]:
                assert http.put("/route", json=registration(rank, port)).status_code == 200

            assert http.get(SIZES).json() == {"prefill_tp_size": 4, "prefill_dp_size": 2, "prefill_pp_size": 1}
            # Rank 3 is TP rank 1 of DP group 1.
            rank = http.get("/route?engine_rank=1&target_dp_group=1")
            assert rank.json() == {"rank_ip": "10.0.0.1", "rank_port": 7003}
            assert http.get("/route?engine_rank=1&target_dp_group=0").status_code == 500
            assert http.get("/route?engine_rank=1").status_code == 400
    finally:
        server.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=TIMEOUT_S)


def test_a_cache_transfer_node_registers_one_layout_and_placement() -> None:
    with start("cache-layouts") as server, httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        assert http.put("/route", json=cache_registration(0, layout(8), STAGES)).status_code == 200

        # Another layout, a placement missing a field, or one whose stage
        # count is not the node's: refused, and nothing recorded.
        refused = [
            cache_registration(1, layout(9), STAGES),
            cache_registration(1, layout(8), [["layer.0.kv"]]),
            cache_registration(1, layout(8), [["layer.0.kv", "layer.1.kv"]]),
            cache_registration(1, layout(8), STAGES, pp_size=1),
        ]
        for body in refused:
            answer = http.put("/route", json=body)
            assert answer.status_code == 500, answer.text
        lookup = "/route?engine_rank=1&target_dp_group=0"
        assert http.get(lookup).status_code == 500

        assert http.put("/route", json=cache_registration(1, layout(8), STAGES)).status_code == 200
        info = http.get(SIZES).json()
        assert info["prefill_pp_size"] == 2
        assert info["cache_fields_by_stage"] == STAGES
        assert CacheLayout.from_wire(info["cache_layout"]) == CacheLayout.from_wire(layout(8))
        assert json.loads(info["cache_layout"]) == json.loads(layout(8))
        assert http.get(lookup).status_code == 200


def test_a_taken_port_is_refused() -> None:
    with start() as server:
        taken = BootstrapSettings(host="127.0.0.1", port=server.port)
        with pytest.raises(BindError, match=f"127.0.0.1:{server.port}"):
            BootstrapServer(taken).start()
