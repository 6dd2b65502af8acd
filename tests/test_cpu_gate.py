"""The CPU gate: co-located nodes share the cores as slots, never more threads than cores."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from services.node.cpu_gate import CpuGate, cpu_gate_for

HOLDER_READY = "holding"


def _holder(path: Path, slots: int, take: int) -> subprocess.Popen[str]:
    """Another process (another node) that holds ``take`` of ``slots`` slots until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from services.node.cpu_gate import CpuGate
        gate = CpuGate({str(path)!r}, slots={slots})
        with gate.hold({take}) as share:
            print({HOLDER_READY!r}, share.threads, flush=True)
            sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == [HOLDER_READY], line
    assert int(line[1]) == take
    return proc


def _release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=10)


def test_alone_a_node_gets_every_slot_it_asks_for(tmp_path: Path) -> None:
    gate = CpuGate(str(tmp_path / "cpu.lock"), slots=4)
    with gate.hold(8) as share:
        assert share.threads == 4 and share.waited_s == 0.0
    with gate.hold(2) as share:
        assert share.threads == 2
    with gate.hold(0) as share:  # a forward always gets at least one core
        assert share.threads == 1


def test_a_node_takes_only_the_slots_another_node_leaves_free(tmp_path: Path) -> None:
    path = tmp_path / "cpu.lock"
    other = _holder(path, slots=4, take=3)
    try:
        with CpuGate(str(path), slots=4).hold(4) as share:
            assert share.threads == 1 and share.waited_s == 0.0
    finally:
        _release(other)
    with CpuGate(str(path), slots=4).hold(4) as share:  # released: every slot is free again
        assert share.threads == 4


def test_a_node_waits_when_every_slot_is_taken_then_takes_only_that_one(tmp_path: Path) -> None:
    """Under contention nodes settle on a share each instead of taking turns with every core."""
    path = tmp_path / "cpu.lock"
    gate = CpuGate(str(path), slots=2)
    other = _holder(path, slots=2, take=2)

    def release_later() -> None:
        time.sleep(0.3)
        _release(other)

    thread = threading.Thread(target=release_later)
    thread.start()
    with gate.hold(2) as share:
        assert share.threads == 1
        assert share.waited_s >= 0.2
    thread.join()


def test_a_dead_node_never_blocks_the_others(tmp_path: Path) -> None:
    path = tmp_path / "cpu.lock"
    other = _holder(path, slots=2, take=2)
    other.kill()
    other.wait(timeout=10)
    with CpuGate(str(path), slots=2).hold(2) as share:
        assert share.threads == 2 and share.waited_s < 1.0


def test_gpu_nodes_and_off_do_not_share(tmp_path: Path) -> None:
    assert cpu_gate_for(str(tmp_path / "cpu.lock"), "cuda") is None
    for off in ("off", "", "none", "OFF"):
        assert cpu_gate_for(off, "cpu") is None
    gate = cpu_gate_for(str(tmp_path / "cpu.lock"), "cpu")
    assert gate is not None and gate.enabled
    gate.close()


def test_an_unopenable_lock_file_means_all_threads_and_a_warning(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    gate = CpuGate(str(tmp_path / "missing-dir" / "cpu.lock"), slots=2)
    assert not gate.enabled
    assert "cannot open the CPU lock" in caplog.text
    with gate.hold(3) as share:
        assert share.threads == 3 and share.waited_s == 0.0
