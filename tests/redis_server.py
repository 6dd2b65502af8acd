"""A real ``redis-server`` for tests: started on a free port, empty, without persistence.

The Redis store's tests run against the real engine (no fake Redis). Where
``redis-server`` is not installed (``make setup`` installs it where apt and
root exist), :func:`require_redis_server` skips the test with the reason; on
CI (``CI`` set) a missing server is a failure, not a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.procs import free_port

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def require_program(name: str, what: str) -> str:
    """The path of the installed program ``name``; skips the test (fails on CI, where ``what`` must run)."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed (make setup installs it with apt where it runs as root)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run {what}")
        pytest.skip(reason)
    return path


def require_redis_server() -> str:
    """The path of ``redis-server``; skips the test (fails on CI) when it is missing."""
    return require_program("redis-server", "the Redis store tests")


@dataclass
class RedisServer:
    """One ``redis-server`` process on 127.0.0.1; :meth:`restart` brings it back empty on the same port."""

    binary: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="meshnet-redis-", suffix=".log")[1]))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", tempfile.gettempdir(), "--loglevel", "warning"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited early:\n{self.log_path.read_text(errors='replace')}")
            if self.ping():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not answer PING in {READY_TIMEOUT_S} s")

    def ping(self) -> bool:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def client(self):  # type: ignore[no-untyped-def]
        """A synchronous client (decoded strings) for a test to look inside."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, socket_timeout=5.0)

    def kill(self) -> None:
        """SIGKILL: everything in memory is lost (there is no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT_S)

    def restart(self) -> RedisServer:
        """Kill and start again, empty, on the same port."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty ``redis-server`` for the block (skips where none is installed)."""
    server = RedisServer(require_redis_server()).start()
    try:
        yield server
    finally:
        server.stop()
