"""meshnet's native CPU kernel for quantized products: built once, found again, or absent and said why.

torch's ``_weight_int4pack_mm_for_cpu`` (what :mod:`services.node.model.quant.packed` used
alone before) costs nearly a pass over the weights for every row it
multiplies: one row of the default model's LM head took 5.3 ms, 8 rows 20 ms
(1 thread), so batched decode rows gained little from riding together.
``kernels/quant_mm.cpp`` unpacks each tile of 16 output rows by one group of
32 inputs once and applies it to up to 16 rows held in registers, with
float32 rows and sums (each group ``s * sum((q - 8) x) + z * sum(x)``);
int8 is held as one signed byte a weight instead of two nibble matrices, GGUF's
5-bit types as six 5-bit integers a dword; a matrix's groups are 32 inputs, or
16 (Q6_K), read from its scales' shape (:mod:`services.node.model.quant.packed`).
AVX-512 when the CPU has it, else the same loops compiled for AVX2+FMA or
for any CPU. From 8 rows on a CPU with AMX (Sapphire Rapids and later) the
tile's integers go to AMX as exact bfloat16 and the rows as three bfloat16
pieces that add up to each float32 exactly, so batches of 8-16 rows cost
little more than one. ``at::parallel_for`` over blocks of output rows, so
``torch.set_num_threads`` (the node's CPU gate) bounds it.

The library is compiled with the C++ compiler torch was built for (``c++``,
or ``$CXX``), against torch's own headers, into a cache folder
(``$MESHNET_KERNEL_CACHE``, else ``~/.cache/meshnet/kernels``) under a name
that hashes the source, torch's version and the flags, so a changed source
or torch builds anew and an unchanged one loads in milliseconds. ``make
setup`` builds it (``python -m services.node.model.quant.quant_kernel``); a node that
finds no build makes one at its first quantized matrix and logs that it is
doing so (about half a minute on 2 cores). Without a compiler, or when the
build or the load fails, :func:`available` is false, the node uses torch's
kernel and logs why, once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Final

import torch
from torch.utils import cpp_extension

logger = logging.getLogger(__name__)

KERNELS: Final = Path(__file__).parent / "kernels"
SOURCES: Final = tuple(KERNELS / name for name in ("quant_mm.cpp", "q8_mm.cpp", "row_attention.cpp",
                                                   "decode_rows.cpp"))
"""Compiled into one library: the quantized product (float32 rows, and int8 rows: ``kernels/q8_mm.cpp``), the
attention of decode rows (``kernels/row_attention.cpp``) and whole decode steps of quantized layers
(``kernels/decode_rows.cpp``), used by :mod:`services.node.model.lean_decode`."""
HEADERS: Final = (KERNELS / "meshnet_kernels.h",)
"""What the sources share; part of the build's hash."""
CACHE_ENV: Final = "MESHNET_KERNEL_CACHE"
"""Environment variable naming the folder built kernels are kept in (default under ``~/.cache``)."""
DEFAULT_CACHE: Final = Path("~/.cache/meshnet/kernels")
LIBRARY_NAME: Final = "meshnet_quant"
LOCK_NAME: Final = "build.lock"
BUILD_TIMEOUT_S: Final = 600
FLAGS: Final = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-DNDEBUG",
                "-Wno-unused-function")
COMPLAINT_LINES: Final = 12
"""The compiler's error lines a failed build reports (torch's headers alone print pages of warnings)."""
COMPLAINT_TAIL_CHARS: Final = 2000
"""Of a failed build's output with no error line, the end it reports."""
ISA_NAMES: Final = {1: "generic", 2: "avx2", 3: "avx512", 4: "amx"}
"""The kernel's instruction-set paths by the number its ``isa`` argument takes (0 picks the best); for int8 rows
(``mm8``) 3 is AVX512-VNNI and 4 AMX-INT8."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _command(compiler: str, output: Path) -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libs = cpp_extension.library_paths()
    return [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes), *map(str, SOURCES),
            *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu", "-o", str(output)]


def library_path() -> Path:
    """Where the build of this source for this torch lives (it may not exist yet)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(f"{torch.__version__}|{sys.version_info[:2]}|{' '.join(FLAGS)}".encode())
    return cache_dir() / f"{LIBRARY_NAME}-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernel into the cache (a temporary name first, so a concurrent node never loads half a
    file); raise ``RuntimeError`` with the compiler's complaint when it cannot."""
    target = library_path()
    if target.exists():
        return target
    failed = target.with_suffix(".failed")
    if failed.exists():  # this source did not compile here before: say so again rather than retry at every start
        raise RuntimeError(f"{failed.read_text()} (delete {failed} to try again)")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) found; install build-essential")
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / LOCK_NAME).open("a") as lock:  # nodes started together build once, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        return _compile(compiler, target)


def _compile(compiler: str, target: Path) -> Path:
    started = time.monotonic()
    logger.info("building meshnet's quantized-product kernel once into %s (about half a minute)", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        partial = Path(work) / target.name
        done = subprocess.run(_command(compiler, partial), capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            problem = f"the kernel did not compile ({compiler}): {complaint(done.stderr)}"
            target.with_suffix(".failed").write_text(problem)
            raise RuntimeError(problem)
        os.replace(partial, target)
    for old in target.parent.glob(f"{LIBRARY_NAME}-*.so"):  # earlier sources' builds (a loaded one stays mapped)
        if old != target:
            old.unlink(missing_ok=True)
    logger.info("built the quantized-product kernel in %.0f s", time.monotonic() - started)
    return target


def complaint(stderr: str) -> str:
    """What a failed build's output says went wrong: its error lines (the compiler's and the assembler's),
    not the end of the output, which is torch's headers' warnings when one of meshnet's own lines failed."""
    errors = [line.strip() for line in stderr.splitlines() if re.search(r"\berror\b", line, re.IGNORECASE)]
    if not errors:
        return stderr.strip()[-COMPLAINT_TAIL_CHARS:]
    more = f" (and {len(errors) - COMPLAINT_LINES} more error lines)" if len(errors) > COMPLAINT_LINES else ""
    return "\n".join(errors[:COMPLAINT_LINES]) + more


@functools.cache
def available() -> bool:
    """Whether the native kernel is loaded (built first when missing); logs once why not."""
    try:
        torch.ops.load_library(str(build()))
        isa = ISA_NAMES[int(torch.ops.meshnet_quant.best_isa())]
    except Exception as error:  # noqa: BLE001 - any failure means torch's kernel, and the log says why
        logger.warning("quantized products use torch's int4 kernel (slower, more with batched rows): %s", error)
        return False
    logger.info("quantized products use meshnet's native kernel (%s)", isa)
    return True


AVX512: Final = 3
"""The ``isa`` number from which the native kernels vectorise (AMX, 4, includes AVX-512)."""


@functools.cache
def row_attention_ready() -> bool:
    """Whether decode rows should attend with the native kernel: loaded, on a CPU with AVX-512 (elsewhere its
    portable loops are slower than torch's products)."""
    return available() and int(torch.ops.meshnet_quant.best_isa()) >= AVX512


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Each KV head's query heads of one decode row against its cache: float32 ``q`` ``[H, G, D]``, ``keys``
    and ``values`` ``[H, L, D]`` (unit stride along ``D``), result ``[H, G, D]`` (``kernels/row_attention.cpp``)."""
    return torch.ops.meshnet_quant.row_attention(q, keys, values, scale)


@functools.cache
def decode_rows_ready() -> bool:
    """Whether decode rows of quantized layers run as one native call (``kernels/decode_rows.cpp``): loaded, on a
    CPU with AVX-512 (its attention's fast path)."""
    return row_attention_ready()


def decode_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: list[torch.Tensor], bits: list[int],
                eps: list[float], keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int],
                scaling: float, heads: int, kv_heads: int) -> torch.Tensor:
    """B decode rows (float32 ``x`` ``[B, hidden]``, each row's rotary ``cos``/``sin`` ``[B, head_dim]``) through
    every layer whose tensors ``weights`` lists, appending to the cache buffers ``keys``/``values`` (layer-major
    (layer, row) pairs, each holding ``lengths`` positions and room for one more); the rows' output
    (``kernels/decode_rows.cpp`` says what each argument holds)."""
    return torch.ops.meshnet_quant.decode_rows(x, cos, sin, weights, bits, eps, keys, values, lengths, scaling, heads,
                                               kv_heads)


def mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bits: int, isa: int = 0) -> torch.Tensor:
    """``x @ W^T`` (float32 ``[B, K]`` rows, float32 ``[B, N]`` result) for a matrix in the native layout, with
    the rows the process chose (:func:`choose_activations`; float32 rows on ``isa`` unless it chose int8)."""
    return torch.ops.meshnet_quant.mm(x, packed, scales, bits, isa)


VNNI: Final = 3
"""The ``isa`` number from which int8 rows run on integer dot products (``kernels/q8_mm.cpp``: AVX512-VNNI; 4, AMX)."""
ACTIVATION_MODES: Final = {"float32": 0, "int8": 1}
Q8_ISA_NAMES: Final = {1: "generic", 2: "avx2", 3: "avx512-vnni", 4: "amx-int8"}


def choose_activations(mode: str) -> str:
    """The rows this process's quantized products take for ``--activations`` ``mode``, and make it so:
    ``int8`` where asked (or, ``auto``, where the CPU has integer dot products: AVX512-VNNI or AMX-INT8, a
    deterministic choice, so nodes on one kind of CPU agree), else ``float32``. Without the native kernel,
    ``float32`` (torch's kernel takes bfloat16 rows). Set once at start: every product of the process follows,
    the decode steps of :mod:`services.node.model.lean_decode` included."""
    if mode not in ("auto", *ACTIVATION_MODES):
        raise ValueError(f"activations must be auto, float32 or int8, not {mode!r}")
    if not available():
        chosen, why = "float32", "meshnet's native kernel is not available"
    elif mode == "auto":
        isa = int(torch.ops.meshnet_quant.q8_best_isa())
        chosen = "int8" if isa >= VNNI else "float32"
        why = f"auto: this CPU's integer dot products are {Q8_ISA_NAMES[isa]}"
    else:
        chosen, why = mode, "asked for"
    if available():
        torch.ops.meshnet_quant.set_activations(ACTIVATION_MODES[chosen])
    logger.info("quantized layers take %s activations (%s)", chosen, why)
    return chosen


def activations() -> str:
    """The rows this process's quantized products take now (``float32`` until :func:`choose_activations`)."""
    if not available():
        return "float32"
    return "int8" if int(torch.ops.meshnet_quant.activations()) else "float32"


def mm8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bits: int, isa: int = 0) -> torch.Tensor:
    """``x @ W^T`` with the rows quantized to int8 per group (``kernels/q8_mm.cpp``; ``isa`` 0 picks the best)."""
    return torch.ops.meshnet_quant.mm8(x, packed, scales, bits, isa)


def main() -> None:
    """``python -m services.node.model.quant.quant_kernel``: build (or find) the kernel, as ``make setup`` does."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not available():
        raise SystemExit(1)
    logger.info("kernel: %s", library_path())


if __name__ == "__main__":
    main()
