"""The deployment files: the compose file validates and names the mesh, the README's settings table is true."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml

from meshnet.settings_doc import SETTINGS_CLASSES, _load, readme_block
from meshwire.exposure import KNOWN_SECRETS
from tests.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
EXPECTED_SERVICES = {"tracker", "relay", "bootstrap", "node-0", "node-1", "prefill-0", "redis", "tracker-b", "gateway"}
NOT_MESHNET = {"redis", "gateway"}
"""The `ha` profile's Redis and HAProxy: they run no meshnet service, so they take no mesh secret."""


def test_the_compose_file_validates_against_the_compose_spec() -> None:
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    result = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_file_names_every_service_with_a_healthcheck() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == EXPECTED_SERVICES
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        if name not in NOT_MESHNET:
            assert "MESHNET_SECRET" in service["environment"], f"{name} does not take the mesh secret"


def test_the_compose_file_requires_a_secret_and_ships_none() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        if name not in NOT_MESHNET:
            assert service["environment"]["MESHNET_SECRET"].startswith("${MESHNET_SECRET:?"), name
    shipped = COMPOSE.read_text() + (ROOT / "deploy" / ".env.example").read_text()
    assert not [secret for secret in KNOWN_SECRETS if f"MESHNET_SECRET={secret}\n" in shipped
                or f":-{secret}}}" in shipped]
    assert re.search(r"^MESHNET_SECRET=$", (ROOT / "deploy" / ".env.example").read_text(), flags=re.MULTILINE)


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


# --- the image and how compose builds it (issue #22: what a real `docker compose up` showed) ---

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROJECT_IMAGE = "${MESHNET_IMAGE:-meshnet:latest}"
SMOKE = ROOT / "scripts" / "compose_smoke.sh"
INDEX_SCRIPT = ROOT / "scripts" / "compose_smoke_index.py"


def _services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), flags=re.MULTILINE))


def test_the_project_image_is_built_once_and_every_other_meshnet_service_runs_it() -> None:
    services = _services()
    meshnet = {name: s for name, s in services.items() if name not in NOT_MESHNET}
    assert all(s["image"] == PROJECT_IMAGE for s in meshnet.values())
    builders = [name for name, s in meshnet.items() if "build" in s]
    assert builders == ["tracker"], f"the project image must be built by one service, not {builders}"
    assert services["tracker"]["build"]["dockerfile"] == "deploy/Dockerfile"


def test_the_build_arguments_come_from_the_environment_with_the_dockerfiles_defaults() -> None:
    args = _services()["tracker"]["build"]["args"]
    defaults = _dockerfile_args()
    for name in ("BASE_IMAGE", "TORCH_INDEX", "TORCH_VERSION"):
        assert args[name] == f"${{{name}:-{defaults[name]}}}", f"{name}: {args[name]} vs Dockerfile's {defaults[name]}"


def test_no_service_leaves_an_anonymous_volume() -> None:
    assert not re.search(r"^\s*VOLUME\b", DOCKERFILE.read_text(), flags=re.MULTILINE), \
        "VOLUME in the Dockerfile leaves an anonymous volume on every service that does not mount it"
    compose = yaml.safe_load(COMPOSE.read_text())
    named = set(compose["volumes"])
    for name, service in compose["services"].items():
        for mount in service.get("volumes", []):
            source = mount.split(":", 1)[0]
            assert ":" in mount and source in named, f"{name} mounts {mount!r}: not a named volume"


LOOPBACK_ONLY = {"bootstrap"}
"""Services published on the host's loopback alone: the bootstrap registry's wire takes anonymous registrations."""


def test_every_published_port_follows_the_publish_address() -> None:
    for name, service in _services().items():
        if name in LOOPBACK_ONLY:
            continue
        for port in service.get("ports", []):
            assert port.startswith("${MESHNET_PUBLISH_ADDR:-0.0.0.0}:${MESHNET_PUBLISH_"), f"{name}: {port}"


def test_the_bootstrap_registry_is_published_on_loopback_only() -> None:
    for name in LOOPBACK_ONLY:
        ports = _services()[name].get("ports", [])
        assert all(port.startswith("127.0.0.1:") for port in ports), f"{name}: {ports}"


def test_the_build_context_holds_what_the_dockerfile_copies_and_not_the_venv() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "the .dockerignore is an allow-list: everything out, then what the image needs"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    copied = set()
    for sources in re.findall(r"^COPY (.+) \S+$", DOCKERFILE.read_text(), flags=re.MULTILINE):
        copied.update(sources.split())
    assert copied and copied <= allowed, f"COPY sources {copied - allowed} are kept out by .dockerignore"
    assert not allowed & {".venv", ".git", "tests", "benchmarks"}


def test_the_smoke_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(SMOKE)], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _tiny_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (PEP 427) holding one module."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in {**files, f"{dist}/RECORD": record}.items():
            wheel.writestr(member, text)
    return path


def test_the_throwaway_index_serves_wheels_that_pip_downloads_and_checks(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _tiny_wheel(wheels, "meshnet_smoke_probe", "1.0")
    subprocess.run([sys.executable, str(INDEX_SCRIPT), str(wheels)], check=True, capture_output=True)
    page = (wheels / "simple" / "meshnet-smoke-probe" / "index.html").read_text()
    assert "meshnet_smoke_probe-1.0-py3-none-any.whl#sha256=" in page
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
                               str(wheels), str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(f"http://127.0.0.1:{port}/simple/")
        out = tmp_path / "out"
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--isolated", "--no-deps", "--dest", str(out),
             "--index-url", f"http://127.0.0.1:{port}/simple", "meshnet-smoke-probe==1.0"],
            check=False, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        assert result.returncode == 0, result.stdout + result.stderr
        assert [p.name for p in out.iterdir()] == ["meshnet_smoke_probe-1.0-py3-none-any.whl"]
    finally:
        server.terminate()
        server.wait(timeout=PIP_TIMEOUT_S)


def test_the_index_refuses_a_folder_without_wheels(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(INDEX_SCRIPT), str(tmp_path)],
                            check=False, capture_output=True, text=True)
    assert result.returncode != 0 and "no wheels" in result.stderr


def wait_until_serving(url: str) -> None:
    """Poll `url` until it answers (bounded by a count, not a clock: the server is local)."""
    for _ in range(SERVE_POLLS):
        try:
            if httpx.get(url, timeout=PIP_TIMEOUT_S).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


PIP_TIMEOUT_S = 120
SERVE_POLLS = 600
