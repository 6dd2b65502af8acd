"""The tracker's live page, seen in a real browser against a real mesh.

A tracker and two tiny-model nodes (``node-a`` holds layers 0-1, ``node-b``
layers 2-3) run as processes; headless Chromium, driven over the DevTools
protocol (:mod:`tests.browser_cdp`), opens ``GET /`` on the tracker, which
sets ``MESHNET_API_KEYS``: then the mesh views (``/v1/mesh``, ``/v1/nodes``)
and the chat answer only to an API key. The tests follow one story in file
order, sharing the mesh and the browser tab (a fresh profile, so no key is
saved): the page first says it needs a key, opening its key box, and shows no
node; a prompt sent without the key is refused with a hint to set it; with the
key typed into the page's key box, the page shows both nodes and full
coverage, and a prompt streams its reply token by token; the page fits a
phone; and, last because they break the mesh, a node killed with SIGKILL
turns ``offline`` on the page with its layers shown as a gap, and a prompt
sent then shows the tracker's error naming those layers.

Screenshots (desktop 1280x900 and phone 390x844) are saved under
``tests/artifacts/``, which git ignores. The tests skip, saying why, where no
Chromium is installed (``make setup`` installs Debian's ``chromium`` where apt
is available).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest

from tests.browser_cdp import Page, find_chromium, launch
from tests.procs import Service, start_service
from tests.requirements import needs

CHROMIUM: Final = find_chromium()

pytestmark = [
    pytest.mark.browser,
    needs(CHROMIUM is not None, "no Chromium on this machine: install Debian's `chromium` package "
                                "(`make setup` does where apt is available)"),
]

ARTIFACTS: Final = Path(__file__).resolve().parent / "artifacts"
DESKTOP: Final = (1280, 900)
PHONE: Final = (390, 844)
NARROWEST: Final = (360, 640)
"""The smallest screen the page is laid out for."""

NODE_TTL_S: Final = 12.0
"""The tracker marks a node offline after this much silence: 24 heartbeats, so that a live node on a loaded
machine is never marked offline by a late heartbeat; the kill test waits for it once."""
HEARTBEAT_S: Final = 0.5
MESH_READY_S: Final = 60.0
"""Upper bound for two registered nodes to make the model complete (generous: 2 shared cores)."""
PAGE_WAIT_S: Final = 30.0
"""Upper bound for the page to show what the tracker already knows (it polls about once a second)."""
OFFLINE_WAIT_S: Final = NODE_TTL_S + 30.0
"""Upper bound for a killed node to show offline: the TTL plus slack for polling and a loaded machine."""
REPLY_WAIT_S: Final = 120.0
MAX_TOKENS: Final = 48
PROMPT: Final = "Where does the river run?"
API_KEY: Final = "page-test-key"

NODES: Final = {"node-a": "0-1", "node-b": "2-3"}


@dataclass
class Mesh:
    """The running mesh: its tracker, its nodes by id, and the model they serve."""

    tracker: Service
    nodes: dict[str, Service]
    model: str


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[Mesh]:
    """A tracker and two nodes splitting the tiny model, with short heartbeat clocks."""
    tracker = start_service("tracker", {"MESHNET_NODE_TTL_S": str(NODE_TTL_S), "MESHNET_HEARTBEAT_S": str(HEARTBEAT_S),
                                        "MESHNET_API_KEYS": API_KEY})
    started: list[Service] = [tracker]
    try:
        nodes = {}
        for node_id, layers in NODES.items():
            nodes[node_id] = start_service("node", {
                "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_LAYERS": layers, "MESHNET_NODE_ID": node_id,
                "MESHNET_TRACKER": tracker.url, "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
                "MESHNET_HEARTBEAT_S": str(HEARTBEAT_S),
            })
            started.append(nodes[node_id])
        _wait_until_complete(tracker)
        yield Mesh(tracker=tracker, nodes=nodes, model=_served_model(tracker))
    finally:
        for service in reversed(started):
            service.stop()


@pytest.fixture(scope="module")
def page(mesh: Mesh) -> Iterator[Page]:
    """One desktop-sized tab showing the tracker's page."""
    assert CHROMIUM is not None
    with launch(CHROMIUM, width=DESKTOP[0], height=DESKTOP[1]) as tab:
        tab.navigate(f"{mesh.tracker.url}/")
        yield tab


def test_without_the_api_key_the_page_opens_its_key_box_and_shows_no_node(page: Page, mesh: Mesh) -> None:
    assert httpx.get(f"{mesh.tracker.url}/v1/mesh", timeout=10.0).status_code == 401, "the mesh view is public"

    page.wait_for("document.getElementById('key-box').open", PAGE_WAIT_S, what="the key box to open by itself")
    conn = page.wait_for("document.getElementById('conn').dataset.state === 'down'"
                         " && document.getElementById('conn-state').textContent", PAGE_WAIT_S,
                         what="the connection shown refused")

    assert "API key" in conn, f"the page does not say it needs an API key: {conn!r}"
    assert page.evaluate("document.querySelectorAll('#node-rows tr').length") == 0, "nodes shown without a key"
    assert page.evaluate("document.querySelectorAll('#model-list .model').length") == 0, "coverage shown without a key"
    assert page.evaluate("document.getElementById('chat-model').options.length") == 0, "models offered without a key"
    assert page.evaluate("document.getElementById('key-flag').textContent") == ""
    nodes_hint = page.evaluate("!document.getElementById('nodes-empty').hidden && document.getElementById('nodes-empty').textContent")
    assert nodes_hint and "API key" in nodes_hint, f"the nodes panel does not say it needs the key: {nodes_hint!r}"
    _screenshot(page, "page-desktop-locked.png")
    assert page.evaluate("document.documentElement.scrollWidth") <= DESKTOP[0], "the open key box widens the page"
    for width, height in (PHONE, NARROWEST):
        page.set_viewport(width, height, mobile=True)
        try:
            page.wait_for(f"window.innerWidth === {width}", PAGE_WAIT_S, what="the small-screen layout")
            box = page.evaluate("(() => { const r = document.getElementById('key-form').getBoundingClientRect();"
                                " return [r.left, r.right, document.documentElement.scrollWidth]; })()")
            assert 0 <= box[0] and box[1] <= width and box[2] <= width, \
                f"the open key box does not fit a {width} px screen: left, right, page width = {box}"
            _screenshot(page, f"page-{width}px-locked.png")
        finally:
            page.set_viewport(*DESKTOP)
    assert page.errors == []


def test_a_prompt_sent_without_the_api_key_is_refused_with_a_hint_to_set_it(page: Page) -> None:
    state, reply = _send_prompt(page, PROMPT)

    assert state == "error"
    assert "API key" in reply
    assert "top right" in reply, f"the refusal does not say where to set the key: {reply!r}"
    assert page.evaluate("document.querySelector('#chat-log .msg.assistant:last-child .bubble').getAttribute('role')") == "alert"


def test_with_the_api_key_typed_the_page_shows_both_nodes_online_and_the_model_fully_covered(page: Page, mesh: Mesh) -> None:
    page.wait_for("document.getElementById('key-box').open", PAGE_WAIT_S, what="the key box open, asking for the key")
    page.evaluate("document.getElementById('key-input').focus()")
    page.insert_text(API_KEY)
    page.evaluate("document.getElementById('key-form').requestSubmit()")

    for node_id in NODES:
        page.wait_for(f"{_row(node_id)}?.dataset.state === 'online'", PAGE_WAIT_S, what=f"{node_id} online")
    model = page.wait_for(f"({_model_card(mesh.model)})?.dataset.complete === 'true' && {_model_card(mesh.model)}.innerText",
                          PAGE_WAIT_S, what="the model shown complete")

    assert "Complete" in model
    assert "missing" not in model
    for node_id, service in mesh.nodes.items():
        row = page.evaluate(f"{_row(node_id)}.innerText")
        assert node_id in row
        assert f"127.0.0.1:{service.port}" in row, f"{node_id}'s endpoint is not shown: {row!r}"
        assert "online" in row, "a state must be written out, not shown by colour alone"
        assert NODES[node_id] in row, f"{node_id}'s layers are not shown: {row!r}"
    assert page.evaluate("document.getElementById('key-box').open") is False, "the key box stays open once the key is saved"
    assert "set" in page.evaluate("document.getElementById('key-flag').textContent")
    assert page.evaluate("document.getElementById('conn').dataset.state") == "live"
    _screenshot(page, "page-desktop-healthy.png")
    assert _foreign_resources(page, mesh) == [], "the page fetched something from outside the tracker"
    assert page.errors == []


def test_a_prompt_typed_in_the_chat_box_streams_a_reply_token_by_token(page: Page, mesh: Mesh) -> None:
    page.evaluate("document.getElementById('chat-clear').click()")
    page.evaluate(f"""(() => {{
        document.getElementById('chat-temperature').value = '0';
        document.getElementById('chat-max-tokens').value = '{MAX_TOKENS}';
        window.__replyLengths = [];
        const log = document.getElementById('chat-log');
        new MutationObserver(() => {{
            const bubble = log.querySelector('.msg.assistant:last-child .bubble');
            if (bubble) window.__replyLengths.push(bubble.textContent.length);
        }}).observe(log, {{ subtree: true, childList: true, characterData: true }});
    }})()""")

    state, reply = _send_prompt(page, PROMPT)
    lengths: list[int] = page.evaluate("window.__replyLengths")

    assert state == "done", f"the reply ended in {state!r}: {reply!r}"
    assert reply, "the reply is empty"
    intermediate = sorted({n for n in lengths if 0 < n < len(reply)})
    assert len(intermediate) >= 2, f"the reply did not grow token by token; lengths seen: {lengths}"
    assert reply == _streamed_reply(mesh), "the page shows other text than the API streams"
    assert page.evaluate("document.getElementById('chat-log').getAttribute('aria-live')") == "polite"
    _screenshot(page, "page-desktop-chat.png")
    assert page.errors == []


@pytest.mark.parametrize("screen", [PHONE, NARROWEST], ids=["phone", "narrowest"])
def test_the_page_fits_a_small_screen_without_sideways_scrolling(page: Page, screen: tuple[int, int]) -> None:
    page.set_viewport(*screen, mobile=True)
    try:
        width = page.wait_for(f"window.innerWidth === {screen[0]} && document.documentElement.scrollWidth",
                              PAGE_WAIT_S, what="the small-screen layout")
        assert width <= screen[0], f"the page is {width} px wide on a {screen[0]} px screen"
        _screenshot(page, f"page-{screen[0]}px-healthy.png")
    finally:
        page.set_viewport(*DESKTOP)


def test_a_killed_node_turns_offline_and_its_layers_show_as_a_gap(page: Page, mesh: Mesh) -> None:
    mesh.nodes["node-b"].kill()

    page.wait_for(f"{_row('node-b')}?.dataset.state === 'offline'", OFFLINE_WAIT_S, what="node-b offline")
    model = page.wait_for(f"({_model_card(mesh.model)})?.dataset.complete === 'false' && {_model_card(mesh.model)}.innerText",
                          PAGE_WAIT_S, what="the model shown incomplete")

    assert "missing layers 2-3" in model
    assert "offline" in page.evaluate(f"{_row('node-b')}.innerText")
    assert page.evaluate(f"{_row('node-a')}.dataset.state") == "online"
    _screenshot(page, "page-desktop-gap.png")
    page.set_viewport(*PHONE, mobile=True)
    try:
        page.wait_for(f"window.innerWidth === {PHONE[0]}", PAGE_WAIT_S, what="the phone layout")
        _screenshot(page, "page-phone-gap.png")
    finally:
        page.set_viewport(*DESKTOP)
    assert page.errors == []


def test_a_prompt_sent_while_layers_are_missing_shows_the_trackers_error_naming_them(page: Page) -> None:
    page.wait_for("document.querySelector('#model-list .model')?.dataset.complete === 'false'", PAGE_WAIT_S,
                  what="the gap left by the killed node")

    state, reply = _send_prompt(page, PROMPT)

    assert state == "error"
    assert "2-3" in reply, f"the error does not name the missing layers: {reply!r}"
    _screenshot(page, "page-desktop-chat-error.png")


# --- helpers -----------------------------------------------------------------------------------------


def _row(node_id: str) -> str:
    """JS: the node's row in the nodes table."""
    return f"document.querySelector('#node-rows tr[data-node-id={json.dumps(node_id)}]')"


def _model_card(model: str) -> str:
    """JS: the model's coverage card (found by its full name, which may be a folder path)."""
    return f"[...document.querySelectorAll('#model-list .model')].find((m) => m.dataset.model === {json.dumps(model)})"


def _send_prompt(page: Page, prompt: str) -> tuple[str, str]:
    """Type ``prompt`` into the chat box, press Send, wait for the reply to end; its state and text."""
    page.evaluate("document.getElementById('chat-input').focus()")
    page.insert_text(prompt)
    page.evaluate("document.getElementById('chat-send').click()")
    state: str = page.wait_for("(() => { const m = document.querySelector('#chat-log .msg.assistant:last-child');"
                               " return m && m.dataset.state !== 'streaming' && m.dataset.state; })()",
                               REPLY_WAIT_S, what="the reply to end")
    reply: str = page.evaluate("document.querySelector('#chat-log .msg.assistant:last-child .bubble').textContent")
    return state, reply


def _screenshot(page: Page, name: str) -> Path:
    return page.screenshot(ARTIFACTS / name)


def _foreign_resources(page: Page, mesh: Mesh) -> list[str]:
    """URLs the page loaded from anywhere but its tracker (data: URLs are inline, not fetched)."""
    urls: list[str] = page.evaluate("performance.getEntriesByType('resource').map((e) => e.name)")
    return [url for url in urls if not url.startswith(mesh.tracker.url) and not url.startswith("data:")]


def _mesh_view(tracker: Service) -> dict[str, Any]:
    """The tracker's mesh view, read as a client holding the API key."""
    answer = httpx.get(f"{tracker.url}/v1/mesh", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10.0)
    answer.raise_for_status()
    view: dict[str, Any] = answer.json()
    return view


def _wait_until_complete(tracker: Service) -> None:
    """Block until the tracker can route the model through both nodes."""
    deadline = time.monotonic() + MESH_READY_S
    while time.monotonic() < deadline:
        view = _mesh_view(tracker)
        if view["models"] and all(model["complete"] for model in view["models"]) and len(view["nodes"]) == len(NODES):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the mesh did not become complete within {MESH_READY_S:.0f} s: {_mesh_view(tracker)}")


def _served_model(tracker: Service) -> str:
    models = [model["model"] for model in _mesh_view(tracker)["models"]]
    assert len(models) == 1, models
    return str(models[0])


def _streamed_reply(mesh: Mesh) -> str:
    """What the tracker streams for the page's request, read with the official OpenAI client."""
    client = openai.OpenAI(base_url=f"{mesh.tracker.url}/v1", api_key=API_KEY, timeout=REPLY_WAIT_S)
    stream = client.chat.completions.create(model=mesh.model, messages=[{"role": "user", "content": PROMPT}],
                                            stream=True, max_tokens=MAX_TOKENS, temperature=0)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
