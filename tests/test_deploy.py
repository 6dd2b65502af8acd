"""The deployment files: the compose file validates and names the mesh, the README's settings table is true."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshnet.settings_doc import SETTINGS_CLASSES, _load, readme_block

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
EXPECTED_SERVICES = {"tracker", "relay", "bootstrap", "node-0", "node-1", "redis", "tracker-b", "gateway"}
NOT_MESHNET = {"redis", "gateway"}
"""The `ha` profile's Redis and HAProxy: they run no meshnet service, so they take no mesh secret."""


def test_the_compose_file_validates_against_the_compose_spec() -> None:
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_file_names_every_service_with_a_healthcheck() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == EXPECTED_SERVICES
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        if name not in NOT_MESHNET:
            assert "MESHNET_SECRET" in service["environment"], f"{name} does not take the mesh secret"


def test_the_two_nodes_split_the_default_model_and_share_a_model_cache_volume() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    layers = [services[f"node-{i}"]["environment"]["MESHNET_LAYERS"] for i in (0, 1)]
    assert layers == ["${MESHNET_NODE0_LAYERS:-0-14}", "${MESHNET_NODE1_LAYERS:-15-29}"]
    for i in (0, 1):
        assert "models:/models" in services[f"node-{i}"]["volumes"]


def test_the_readme_settings_table_is_generated_from_the_settings_classes() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme_block() in readme, "README's settings table is stale: run `python -m meshnet.settings_doc --write README.md`"


@pytest.mark.parametrize(("title", "path"), SETTINGS_CLASSES)
def test_every_setting_loads_from_its_environment_twin(title: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = _load(path)
    assert "port" in cls.model_fields, f"{title} has no port setting"
    monkeypatch.setenv("MESHNET_PORT", "18123")
    assert cls().port == 18123
