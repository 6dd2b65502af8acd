"""`meshnet chat "prompt"`: one streamed chat answer from a tracker, printed as it arrives."""

from __future__ import annotations

import sys

import httpx
import orjson
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from meshwire import tls

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 300.0


class ChatSettings(BaseSettings):
    """Where to ask and how to sample."""

    model_config = SettingsConfigDict(env_prefix="MESHNET_", extra="ignore", frozen=True)

    url: str = Field("http://127.0.0.1:8000", description="the tracker's base URL")
    model: str | None = Field(None, description="model id (default: the first model the tracker lists)")
    max_tokens: int = Field(256, ge=1, description="most tokens to generate")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy")
    api_key: str | None = Field(None, description="a client API key, when the tracker requires one")
    tls_ca: str | None = Field(None, description="PEM CA bundle an https tracker is verified with "
                                                 "(unset: the default trusted roots)")


def _first_model(client: httpx.Client, base: str) -> str:
    answer = client.get(f"{base}/v1/models")
    answer.raise_for_status()
    models = answer.json().get("data") or []
    if not models:
        raise RuntimeError("the tracker lists no model with a complete route yet (are the nodes up?)")
    return str(models[0]["id"])


def run_chat(settings: ChatSettings, prompt: str) -> int:
    """Stream one answer to stdout; return the process exit code."""
    base = settings.url.rstrip("/")
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    try:
        with httpx.Client(timeout=timeout, headers=headers, verify=tls.httpx_verify(settings.tls_ca)) as client:
            model = settings.model or _first_model(client, base)
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": settings.max_tokens,
                "temperature": settings.temperature,
                "stream": True,
            }
            with client.stream("POST", f"{base}/v1/chat/completions", json=body) as answer:
                if answer.status_code != 200:
                    answer.read()
                    print(f"meshnet chat: {answer.status_code}: {answer.text}", file=sys.stderr)
                    return 1
                for line in answer.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = orjson.loads(data)
                    if "error" in event:
                        print(f"\nmeshnet chat: {event['error'].get('message')}", file=sys.stderr)
                        return 1
                    for choice in event.get("choices", []):
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            sys.stdout.write(text)
                            sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"meshnet chat: cannot reach the mesh at {base}: {exc}", file=sys.stderr)
        return 1
