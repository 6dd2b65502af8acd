"""A dishonest hop for attack tests: every frame it is sent, it answers that an honest node after it failed.

``uvicorn tests.fake_liar:app`` serves ``GET /health`` and ``POST /forward``
(and ``/forward/rows``), which answer 502 ``hop_failed`` naming
``FAKE_LIAR_BLAMES`` as ``failed_node``, with no signed word of that node's
predecessor (it has none to give): what a member runs to put an honest node
after it in backoff through the head's report.
"""

from __future__ import annotations

import os
from typing import Final

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

BLAMES: Final = os.environ.get("FAKE_LIAR_BLAMES", "honest")


async def forward(request: Request) -> JSONResponse:
    return JSONResponse({"error": {"message": f"hop {BLAMES} failed: connection refused", "type": "server_error",
                                   "code": "hop_failed", "failed_node": BLAMES}}, status_code=502)


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


app = Starlette(routes=[Route("/health", health), Route("/forward", forward, methods=["POST"]),
                        Route("/forward/rows", forward, methods=["POST"])])
