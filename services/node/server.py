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


def _refuse_unserved_gguf(settings: NodeSettings) -> None:
    """A GGUF whose architecture, hyper-parameters or tensor formats are not served stops the node here, in one
    line; one that is served has its metadata folder prepared (once; the runtime then finds it ready)."""
    from pathlib import Path

    from services.node.model.gguf_model import GgufModelError, is_gguf, prepare_gguf_folder
    from services.node.model.model_source import default_cache_dir

    path = Path(settings.model).expanduser()
    if not is_gguf(path):
        return
    try:
        prepare_gguf_folder(path, settings.model_cache_dir or default_cache_dir())
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
    openmp.configure()  # before torch loads: the node's modules import it
    _refuse_unserved_gguf(settings)
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
