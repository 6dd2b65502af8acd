# HAProxy in front of the `ha` profile's two trackers (deploy/haproxy.cfg). Built FROM the project's
# BASE_IMAGE with Debian's haproxy, because Docker Hub may not be reachable where the mesh is built.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends haproxy \
    && rm -rf /var/lib/apt/lists/*
COPY haproxy.cfg /etc/haproxy/haproxy.cfg
ENV MESHNET_GATEWAY_BIND=:8000 \
    MESHNET_TRACKER_A=tracker:8000 \
    MESHNET_TRACKER_B=tracker-b:8000
EXPOSE 8000
CMD ["haproxy", "-W", "-db", "-f", "/etc/haproxy/haproxy.cfg"]
