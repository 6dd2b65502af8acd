# Redis for the `ha` profile's trackers (MESHNET_STORE=redis://redis:6379/0). Built FROM the
# project's BASE_IMAGE with Debian's redis-server, because Docker Hub may not be reachable.
# No persistence: a Redis that restarts empty is whole again from the nodes' next heartbeats.
# It listens on the compose network only (no published port); expired-key events are on for the
# trackers (they also ask for them at connect).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no", \
     "--notify-keyspace-events", "Ex"]
