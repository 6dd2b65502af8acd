"""Node settings: every field has a MESHNET_ twin, and layer ranges are checked where they are read."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.node.settings import NodeSettings


def test_every_setting_is_read_from_its_meshnet_environment_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHNET_LAYERS", "2-5")
    monkeypatch.setenv("MESHNET_KV_BUDGET_TOKENS", "4096")
    monkeypatch.setenv("MESHNET_TRACKER", "http://tracker:8000/")
    settings = NodeSettings()
    assert settings.layer_range() == (2, 5)
    assert settings.kv_budget_tokens == 4096
    assert settings.tracker == ("http://tracker:8000",)


def test_no_layers_means_every_layer() -> None:
    assert NodeSettings(layers=None).layer_range() is None


@pytest.mark.parametrize("layers", ["5-2", "a-b", "3", "1-2-3", "-1-4"])
def test_a_malformed_layer_range_is_refused(layers: str) -> None:
    with pytest.raises(ValidationError, match="layers"):
        NodeSettings(layers=layers)


def test_the_public_url_defaults_to_host_and_port_and_a_wildcard_host_is_made_dialable() -> None:
    assert NodeSettings(host="127.0.0.1", port=8101).public_url() == "http://127.0.0.1:8101"
    assert NodeSettings(host="0.0.0.0", port=8101).public_url() == "http://127.0.0.1:8101"
    assert NodeSettings(advertise="http://node-a.lan:9000/").public_url() == "http://node-a.lan:9000"


def test_an_unknown_device_is_refused() -> None:
    with pytest.raises(ValidationError, match="device"):
        NodeSettings(device="tpu")


def test_a_generated_node_id_is_a_valid_id() -> None:
    assert NodeSettings().resolved_node_id().startswith("node-")
