"""The bootstrap service's routes, statuses and content types, in process (``httpx.ASGITransport``)."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.bootstrap.app import create_app
from services.bootstrap.settings import BootstrapSettings
from tests.bootstrap_samples import STAGES, cache_registration, layout, registration

SIZES = "/route?engine_rank=-1&target_dp_group=-1"


def client_for(**settings: Any) -> httpx.AsyncClient:
    app = create_app(BootstrapSettings(**settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bootstrap")


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with client_for() as client:
        yield client


def is_text(answer: httpx.Response) -> bool:
    return answer.headers["content-type"].startswith("text/plain")


async def test_health_answers_ok_as_plain_text(http: httpx.AsyncClient) -> None:
    answer = await http.get("/health")
    assert (answer.status_code, answer.text) == (200, "OK")
    assert is_text(answer)


async def test_a_registration_is_answered_ok_as_plain_text(http: httpx.AsyncClient) -> None:
    answer = await http.put("/route", json=registration(0))
    assert (answer.status_code, answer.text) == (200, "OK")
    assert is_text(answer)


async def test_lookups_answer_json(http: httpx.AsyncClient) -> None:
    await http.put("/route", json=registration(3, port=7003))
    sizes = await http.get(SIZES)
    assert sizes.headers["content-type"] == "application/json"
    assert sizes.json() == {"prefill_tp_size": 4, "prefill_dp_size": 2, "prefill_pp_size": 1}
    rank = await http.get("/route", params={"engine_rank": 1, "target_dp_group": 1})
    assert rank.headers["content-type"] == "application/json"
    assert rank.json() == {"rank_ip": "10.0.0.1", "rank_port": 7003}


async def test_a_cache_layouts_service_serves_layout_and_placement() -> None:
    async with client_for(registry="cache-layouts") as http:
        assert (await http.put("/route", json=cache_registration(0))).status_code == 200
        info = (await http.get(SIZES)).json()
    assert info["cache_layout"] == layout()
    assert info["cache_fields_by_stage"] == STAGES
    assert info["prefill_pp_size"] == 2


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/route"), ("DELETE", "/route"), ("PATCH", "/route"), ("OPTIONS", "/route"),
    ("PUT", "/health"), ("POST", "/health"), ("DELETE", "/health"), ("POST", "/metrics"),
])
async def test_another_method_on_a_known_path_is_405_as_text(
        http: httpx.AsyncClient, method: str, path: str) -> None:
    answer = await http.request(method, path, content=b"{}")
    assert (answer.status_code, answer.text) == (405, "Method not allowed")
    assert is_text(answer)


async def test_head_is_another_method(http: httpx.AsyncClient) -> None:
    assert (await http.head("/health")).status_code == 405


@pytest.mark.parametrize("path", ["/", "/nope", "/health/", "/route/", "/docs", "/redoc", "/openapi.json",
                                  "/ROUTE", "/route/extra"])
async def test_any_other_path_is_404_as_text(http: httpx.AsyncClient, path: str) -> None:
    for method in ("GET", "PUT"):
        answer = await http.request(method, path)
        assert (answer.status_code, answer.text) == (404, "Not Found")
        assert is_text(answer)


async def test_a_refused_registration_is_a_500_with_the_reason_as_text(http: httpx.AsyncClient) -> None:
    answer = await http.put("/route", content=b"{not json")
    assert (answer.status_code, answer.text) == (500, "the registration is not JSON")
    assert is_text(answer)


async def test_a_lookup_without_inputs_is_a_400_as_text(http: httpx.AsyncClient) -> None:
    answer = await http.get("/route?engine_rank=1")
    assert (answer.status_code, answer.text) == (400, "Missing inputs for bootstrap server.")
    assert is_text(answer)


@pytest.mark.parametrize("target", ["/route?engine_rank&target_dp_group", "/route?engine_rank=&target_dp_group=0",
                                    "/route"])
async def test_empty_query_values_are_missing_inputs(http: httpx.AsyncClient, target: str) -> None:
    assert (await http.get(target)).status_code == 400


async def test_query_values_are_percent_decoded(http: httpx.AsyncClient) -> None:
    await http.put("/route", json=registration(3, port=7003))
    assert (await http.get("/route?engine_rank=%2B1&target_dp_group=%201")).json()["rank_port"] == 7003
    assert (await http.get("/route?engine_rank=%2D1&target_dp_group=-1")).json()["prefill_dp_size"] == 2


async def test_no_refusal_ever_answers_json(http: httpx.AsyncClient) -> None:
    requests = [("PUT", "/route", b"[]"), ("PUT", "/route", b"\x00"), ("GET", "/route?engine_rank=x", b""),
                ("GET", "/route?engine_rank=x&target_dp_group=y", b""), ("GET", "/nowhere", b""),
                ("PUT", "/health", b""), ("GET", "/route?engine_rank=9&target_dp_group=9", b"")]
    for method, target, body in requests:
        answer = await http.request(method, target, content=body)
        assert answer.status_code >= 400
        assert is_text(answer), (method, target, answer.headers)
        assert not answer.text.startswith("{"), (method, target, answer.text)


async def test_a_declared_body_over_the_cap_is_a_413() -> None:
    async with client_for(max_body_bytes=64) as http:
        answer = await http.put("/route", content=b" " * 65)
        assert (answer.status_code, answer.text) == (413, "request body over 64 bytes")
        assert answer.headers["connection"] == "close"
        assert (await http.put("/route", content=b" " * 64)).status_code == 500  # read, then not JSON


async def test_metrics_count_requests_by_route_and_status_and_the_ranks(http: httpx.AsyncClient) -> None:
    await http.put("/route", json=registration(0))
    await http.put("/route", json=registration(3))
    await http.get("/route?engine_rank=7&target_dp_group=7")
    await http.get("/somewhere/else")
    page = await http.get("/metrics")
    assert page.status_code == 200
    text = page.text
    assert 'meshnet_bootstrap_requests_total{method="PUT",route="/route",status="200"} 2.0' in text
    assert 'meshnet_bootstrap_requests_total{method="GET",route="/route",status="500"} 1.0' in text
    assert 'meshnet_bootstrap_requests_total{method="GET",route="other",status="404"} 1.0' in text
    assert "meshnet_bootstrap_registered_ranks 2.0" in text
    assert 'meshnet_bootstrap_request_seconds_count{route="/route"} 3.0' in text


async def test_two_apps_keep_separate_tables() -> None:
    async with client_for() as first, client_for() as second:
        await first.put("/route", json=registration(0))
        assert (await second.get(SIZES)).json()["prefill_tp_size"] is None


async def test_the_module_app_is_configured_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHNET_REGISTRY", "cache-layouts")
    module = importlib.import_module("services.bootstrap.app")
    module.__dict__.pop("app", None)
    try:
        app = module.app
        assert module.app is app
        assert app.state.registry.kind == "cache-layouts"
    finally:
        module.__dict__.pop("app", None)
