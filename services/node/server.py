"""Run a node in this process: what ``meshnet node`` calls."""

from __future__ import annotations

import logging
import sys

import uvicorn

from meshwire import exposure, serving
from meshwire.auth import DEFAULT_SECRET
from meshwire.logs import configure_logging
from services.node.engine import openmp
from services.node.settings import NodeSettings

logger = logging.getLogger(__name__)


def _refuse_unserved_gguf(model: str) -> None:
    """A GGUF whose architecture or tensor formats are not served stops the node here, in one line."""
    from pathlib import Path

    from services.node.model.gguf_model import GgufModelError, check_servable, is_gguf

    path = Path(model).expanduser()
    if not is_gguf(path):
        return
    try:
        check_servable(path)
    except GgufModelError as exc:
        print(f"meshnet node: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(settings: NodeSettings) -> None:
    """Serve ``settings``' node until interrupted.

    The device and dtype are chosen (and logged, with the reason) when the
    layers load; the ready line names both. Refuses
    (:class:`~meshwire.exposure.UnsafeSecret`) to listen beyond loopback with
    an empty or published secret.
    """
    if not settings.join_token:  # a node that joins by token holds no secret: nothing to leak
        exposure.require_private_secret("the node", settings.host, settings.secret)
    _refuse_unserved_gguf(settings.model)
    openmp.configure()  # before torch loads: the node's modules import it
    from services.node.app import create_app

    configure_logging()
    if settings.secret == DEFAULT_SECRET and not settings.join_token:  # with a join token the secret is unused
        logger.warning("MESHNET_SECRET is the development default: anyone who knows it can use this mesh")
    logger.info("starting node on %s:%d (model %s, layers %s, device %s, dtype %s)", settings.host, settings.port,
                settings.model, settings.layers or "all", settings.device, settings.dtype)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                timeout_graceful_shutdown=10,
                **serving.uvicorn_options(tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                                          head_timeout_s=settings.head_timeout_s,
                                          max_connections_per_address=settings.max_connections_per_address))
