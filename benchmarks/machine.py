"""The machine a benchmark ran on, gathered automatically for the README and every JSON result.

Numbers without the machine are meaningless: the CPU model, the cores torch
uses, the library versions and the load average when the run began (the
machine may be shared) travel with every result.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Final

from pydantic import BaseModel, ConfigDict

CPUINFO: Final = Path("/proc/cpuinfo")
CPU_FLAGS_OF_NOTE: Final = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "f16c")
"""Instruction sets that decide which number format is fastest on a CPU (DESIGN.md section 8)."""
PACKAGES: Final = ("torch", "transformers", "fastapi", "uvicorn", "httpx")


class Machine(BaseModel):
    """What a reader needs to compare a result with their own machine."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    cpu_model: str
    logical_cores: int
    torch_threads: int
    cpu_flags: tuple[str, ...]
    """The subset of :data:`CPU_FLAGS_OF_NOTE` this CPU has."""
    memory_gib: float | None
    os: str
    python: str
    packages: dict[str, str]
    load_average_1m: float
    """Load average when the run began: above zero, something else was using the cores."""

    def one_line(self) -> str:
        """A compact description for a table caption or a plot title."""
        versions = ", ".join(f"{name} {version}" for name, version in self.packages.items()
                             if name in ("torch", "transformers"))
        return f"{self.cpu_model}, {self.logical_cores} cores ({self.torch_threads} torch threads), {versions}"


def describe_machine() -> Machine:
    """Look at this machine now."""
    import torch  # imported here: describing the machine is the only reason this module needs it

    model, flags = _cpu()
    return Machine(
        cpu_model=model,
        logical_cores=os.cpu_count() or 1,
        torch_threads=torch.get_num_threads(),
        cpu_flags=tuple(flag for flag in CPU_FLAGS_OF_NOTE if flag in flags),
        memory_gib=_memory_gib(),
        os=f"{platform.system()} {platform.release()}",
        python=sys.version.split()[0],
        packages={name: _version(name) for name in PACKAGES},
        load_average_1m=round(os.getloadavg()[0], 2),
    )


def _cpu() -> tuple[str, frozenset[str]]:
    model = platform.processor() or platform.machine()
    flags: frozenset[str] = frozenset()
    try:
        text = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def _memory_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * page_size / (1 << 30), 1)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"
