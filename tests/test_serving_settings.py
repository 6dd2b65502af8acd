"""The TLS and slow-client settings every service shares (meshwire.serving): one block, the same in all four."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from meshwire import slow_clients
from meshwire.serving import ListenerSettings, SlowClientSettings, TlsClientSettings
from services.bootstrap.settings import BootstrapSettings
from services.node.settings import NodeSettings
from services.relay.settings import RelaySettings
from services.tracker.settings import TrackerSettings

SERVICES: tuple[type[BaseSettings], ...] = (TrackerSettings, NodeSettings, RelaySettings, BootstrapSettings)
WITH_DEADLINES = (TrackerSettings, NodeSettings, RelaySettings)
WITH_CLIENT_CA = (TrackerSettings, NodeSettings)


@pytest.mark.parametrize("cls", SERVICES, ids=lambda cls: cls.__name__)
def test_every_service_has_the_block_it_serves_with(cls: type[BaseSettings]) -> None:
    assert issubclass(cls, ListenerSettings)
    assert issubclass(cls, SlowClientSettings) == (cls in WITH_DEADLINES)
    assert issubclass(cls, TlsClientSettings) == (cls in WITH_CLIENT_CA)


@pytest.mark.parametrize("cls", SERVICES, ids=lambda cls: cls.__name__)
def test_the_shared_settings_have_the_same_names_and_defaults_everywhere(
        cls: type[BaseSettings], monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = cls()
    assert (defaults.tls_cert, defaults.tls_key) == (None, None)  # type: ignore[attr-defined]
    assert defaults.max_connections_per_address == slow_clients.MAX_CONNECTIONS_PER_ADDRESS  # type: ignore[attr-defined]
    monkeypatch.setenv("MESHNET_MAX_CONNECTIONS_PER_ADDRESS", "7")
    assert cls().max_connections_per_address == 7  # type: ignore[attr-defined]
    if cls in WITH_DEADLINES:
        assert (defaults.head_timeout_s, defaults.body_timeout_s) == (  # type: ignore[attr-defined]
            slow_clients.HEAD_TIMEOUT_S, slow_clients.BODY_TIMEOUT_S)
        monkeypatch.setenv("MESHNET_BODY_TIMEOUT_S", "3")
        assert cls().body_timeout_s == 3.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", SERVICES, ids=lambda cls: cls.__name__)
def test_a_certificate_without_its_key_is_refused(cls: type[BaseSettings], tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not checked here")
    with pytest.raises(ValidationError, match="tls_cert and tls_key go together"):
        cls(tls_cert=str(cert))


@pytest.mark.parametrize("cls", WITH_CLIENT_CA, ids=lambda cls: cls.__name__)
def test_a_client_ca_that_is_not_there_is_refused(cls: type[BaseSettings], tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="tls_ca: no such file"):
        cls(tls_ca=str(tmp_path / "absent.pem"))


@pytest.mark.parametrize("cls", SERVICES, ids=lambda cls: cls.__name__)
def test_the_shared_fields_are_described_for_help_and_the_readme(cls: type[BaseSettings]) -> None:
    for name in ListenerSettings.model_fields:
        assert cls.model_fields[name].description, f"{cls.__name__}.{name} has no description"
