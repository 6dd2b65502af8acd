"""The CPU gate: co-located nodes share the cores as slots, never more threads than cores."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from services.node.engine.cpu_gate import CONTENTION_MEMORY_S, CpuGate, cpu_gate_for

HOLDER_READY = "holding"
NOT_TAKEN_LOOK_S = 0.3
"""How long the test looks for a slot wrongly taken; any length is correct (nothing may be taken)."""
EVENT_TIMEOUT_S = 60.0
"""A bound on waiting for an event that must come, generous for a loaded machine."""


def _holder(path: Path, slots: int, take: int) -> subprocess.Popen[str]:
    """Another process (another node) that holds ``take`` of ``slots`` slots until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from services.node.engine.cpu_gate import CpuGate
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
    taken = threading.Event()
    shares = []

    def hold() -> None:
        with gate.hold(2) as share:
            shares.append(share)
            taken.set()

    thread = threading.Thread(target=hold)
    thread.start()
    try:  # while the other node holds every slot, nothing is taken, however long we look
        assert not taken.wait(NOT_TAKEN_LOOK_S), "a slot was taken while another node held them all"
    finally:
        _release(other)
    assert taken.wait(EVENT_TIMEOUT_S), "the slot freed by the other node was never taken"
    thread.join(EVENT_TIMEOUT_S)
    assert shares[0].threads == 1 and shares[0].waited_s > 0.0


def test_a_dead_node_never_blocks_the_others(tmp_path: Path) -> None:
    path = tmp_path / "cpu.lock"
    other = _holder(path, slots=2, take=2)
    other.kill()
    other.wait(timeout=10)
    with CpuGate(str(path), slots=2).hold(2) as share:  # both slots: the dead holder's were freed with it
        assert share.threads == 2


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


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_after_meeting_another_node_a_node_keeps_to_half_the_slots_for_a_while_then_takes_all_again(
        tmp_path: Path) -> None:
    """Two streams over a 2-node mesh: a node that found the other computing keeps to its share even when
    the other is between two steps, so the other's next step runs beside it instead of waiting for it."""
    path = tmp_path / "cpu.lock"
    clock = _Clock()
    gate = CpuGate(str(path), slots=4, clock=clock)
    with gate.hold(4) as share:
        assert share.threads == 4 and not gate.sharing  # alone: every core
    other = _holder(path, slots=4, take=1)
    try:
        with gate.hold(4) as share:
            assert share.threads == 3  # what the other left free, and it met the other
    finally:
        _release(other)
    assert gate.sharing
    clock.now += CONTENTION_MEMORY_S / 2
    with gate.hold(4) as share:  # every slot free, but the other node computed a moment ago
        assert share.threads == 2
    clock.now += CONTENTION_MEMORY_S
    assert not gate.sharing
    with gate.hold(4) as share:  # nobody met for a while: a lone stream has every core again
        assert share.threads == 4


def test_a_node_keeping_to_its_share_still_notices_the_other_node_on_the_slots_it_does_not_take(
        tmp_path: Path) -> None:
    path = tmp_path / "cpu.lock"
    clock = _Clock()
    gate = CpuGate(str(path), slots=2, clock=clock)
    other = _holder(path, slots=2, take=1)  # one slot, whichever its pid starts at
    try:
        with gate.hold(1) as share:  # one thread wanted: taken at once, the other slot only looked at
            assert share.threads == 1 and share.waited_s == 0.0
        assert gate.sharing
    finally:
        _release(other)
