"""What `make compose-smoke` asks of the mesh that `docker compose up --wait` started.

    python scripts/compose_smoke_check.py --url http://127.0.0.1:PORT [--nodes 3]

As a user would: the model list, a chat that answers "Paris", the same question streamed through
the official `openai` client, and the live page with the mesh data it draws (every node online,
the model's layers all covered). Exits non-zero, naming the check and what came back, at the
first that fails. Each request has a time limit (REQUEST_TIMEOUT_S), so a stuck mesh fails
rather than hangs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import httpx
from openai import OpenAI, OpenAIError

log = logging.getLogger("compose_smoke_check")

QUESTION = "What is the capital of France? Answer in one sentence."
EXPECTED = "Paris"
MAX_TOKENS = 40
REQUEST_TIMEOUT_S = 120.0  # a CPU chat of 40 tokens through two containers takes seconds
MAX_SHOWN_CHARS = 300  # of an unexpected answer, in the failure message


class CheckFailed(Exception):
    """One check did not see what a user must see."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def check_models(http: httpx.Client) -> str:
    """GET /v1/models lists the served model; return its id."""
    response = http.get("/v1/models")
    _expect(response.status_code == 200, f"GET /v1/models answered {response.status_code}: {response.text[:MAX_SHOWN_CHARS]}")
    models = [entry["id"] for entry in response.json().get("data", [])]
    _expect(len(models) >= 1, f"GET /v1/models lists no model: {response.text[:MAX_SHOWN_CHARS]}")
    log.info("GET /v1/models: %s", ", ".join(models))
    return models[0]


def check_chat(client: OpenAI, model: str) -> None:
    """A plain chat answers the question."""
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=MAX_TOKENS, temperature=0)
    text = reply.choices[0].message.content or ""
    _expect(EXPECTED in text, f"the chat answered {text[:MAX_SHOWN_CHARS]!r}, without {EXPECTED!r}")
    log.info("chat: %r", text)


def check_streamed_chat(client: OpenAI, model: str) -> None:
    """The same question streamed: several chunks, which together answer it."""
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    text = "".join(pieces)
    _expect(sum(1 for piece in pieces if piece) > 1, f"the stream came in {len(pieces)} chunk(s): {text!r}")
    _expect(EXPECTED in text, f"the streamed chat answered {text[:MAX_SHOWN_CHARS]!r}, without {EXPECTED!r}")
    log.info("streamed chat: %d chunks, %r", len(pieces), text)


def check_page(http: httpx.Client, nodes: int) -> None:
    """The live page is served, and the data it draws shows every node online and the model covered."""
    response = http.get("/")
    _expect(response.status_code == 200, f"GET / answered {response.status_code}")
    _expect(response.headers.get("content-type", "").startswith("text/html"),
            f"GET / is {response.headers.get('content-type')!r}, not the HTML page")
    _expect("mesh monitor" in response.text, "GET / is not the mesh monitor page")
    mesh = http.get("/v1/mesh")
    _expect(mesh.status_code == 200, f"GET /v1/mesh answered {mesh.status_code}: {mesh.text[:MAX_SHOWN_CHARS]}")
    body = mesh.json()
    online = sorted(node["node_id"] for node in body["nodes"] if node.get("state") == "online")
    _expect(len(online) == nodes, f"the page's data shows {online} online, not {nodes} nodes")
    complete = [model for model in body["models"] if model.get("complete")]
    _expect(len(complete) >= 1, f"the page's data shows no model fully covered: {body['models']}")
    log.info("page: served; nodes online %s; fully covered %s", online, [m.get("model") for m in complete])


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[compose-smoke check] %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the tracker's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--nodes", type=int, default=3,
                        help="how many nodes the compose file starts (two decode nodes and a prefill node)")
    args = parser.parse_args()
    started = time.monotonic()
    try:
        with httpx.Client(base_url=args.url, timeout=REQUEST_TIMEOUT_S) as http:
            model = check_models(http)
            client = OpenAI(base_url=f"{args.url}/v1", api_key="not-needed", timeout=REQUEST_TIMEOUT_S,
                            max_retries=0)
            check_chat(client, model)
            check_streamed_chat(client, model)
            check_page(http, args.nodes)
    except CheckFailed as exc:
        log.error("FAILED: %s", exc)
        return 1
    except (httpx.HTTPError, OpenAIError, OSError) as exc:
        log.error("FAILED: %s: %s", type(exc).__name__, exc)
        return 1
    log.info("all checks passed in %.1f s", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
