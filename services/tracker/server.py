"""Running the tracker from the command line (``meshnet tracker``)."""

from __future__ import annotations

import logging

import uvicorn

from meshwire import exposure, serving
from meshwire.auth import DEFAULT_SECRET

from .app import create_app
from .settings import TrackerSettings

logger = logging.getLogger(__name__)


def serve(settings: TrackerSettings) -> None:
    """Serve the tracker on ``settings.host:settings.port`` until interrupted.

    Refuses (:class:`~meshwire.exposure.UnsafeSecret`) to listen beyond
    loopback with an empty or published secret.
    """
    exposure.require_private_secret("the tracker", settings.host, settings.secret)
    if settings.secret == DEFAULT_SECRET:
        logger.warning("MESHNET_SECRET is the development default: set a secret of your own "
                       "before nodes join over a network")
    logger.info("tracker starting: point the OpenAI SDK at %s/v1", settings.url)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                access_log=False,
                **serving.uvicorn_options(tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                                          head_timeout_s=settings.head_timeout_s,
                                          max_connections_per_address=settings.max_connections_per_address))
