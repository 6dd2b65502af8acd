"""``--device`` and ``--dtype`` resolve to a torch device and number format, or to a clear error.

``--dtype auto`` is a pure function of the hardware: these tests give it fake
CPU features and GPU capabilities and check it answers as the measured table
says, and the same every time.
"""

from __future__ import annotations

import json
import logging
from itertools import pairwise
from pathlib import Path
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.node.model import device as device_module
from services.node.model.device import (
    CPU_DTYPE_TABLE,
    DTYPES,
    CpuClass,
    CpuClassName,
    DeviceError,
    auto_dtype,
    choose_cpu_dtype,
    choose_cuda_dtype,
    chunk_compute_dtype,
    classify_cpu,
    cpu_class,
    cpu_features,
    parse_cpu_features,
    pick_device,
    pick_dtype,
)

CPU = torch.device("cpu")
RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "dtype_table.json"

AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
SAPPHIRE_RAPIDS = frozenset(AVX512 | {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"})
GRANITE_RAPIDS = SAPPHIRE_RAPIDS | {"amx_fp16"}
EPYC_ZEN4 = frozenset(AVX512 | {"avx512_bf16", "avx512_vnni"})
ICE_LAKE = frozenset(AVX512 | {"avx512_vnni", "avx512ifma"})
HASWELL = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
WESTMERE = frozenset({"sse4_2", "popcnt"})
GRAVITON3 = frozenset({"fp", "asimd", "fphp", "asimdhp", "bf16", "i8mm", "sve"})
CORTEX_A76 = frozenset({"fp", "asimd", "fphp", "asimdhp", "asimddp"})
CORTEX_A72 = frozenset({"fp", "asimd", "evtstrm", "crc32", "cpuid"})


def test_cpu_is_the_cpu() -> None:
    assert pick_device("cpu") == CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_auto_falls_back_to_the_cpu_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert pick_device("auto") == CPU
    assert "no CUDA device" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "CUDA:1"])
def test_a_cuda_device_is_refused_where_torch_sees_none(name: str) -> None:
    with pytest.raises(DeviceError, match="no CUDA device"):
        pick_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "mps0", ""])
def test_an_unknown_device_is_refused_naming_the_choices(name: str) -> None:
    with pytest.raises(DeviceError, match="use auto, cpu, cuda or cuda:N"):
        pick_device(name)


@pytest.mark.parametrize(
    ("name", "dtype"), [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("Float16", torch.float16)]
)
def test_an_explicit_dtype_is_taken_as_given(name: str, dtype: torch.dtype) -> None:
    assert pick_dtype(name, CPU) == dtype
    assert pick_dtype(name, CPU, rows=16) == dtype


@pytest.mark.parametrize("name", ["fp8", "half", "int8"])
def test_an_unknown_dtype_is_refused_naming_the_choices(name: str) -> None:
    with pytest.raises(DeviceError, match="use auto, float32, bfloat16 or float16"):
        pick_dtype(name, CPU)


def test_auto_dtype_on_the_cpu_says_what_it_chose_and_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        chosen = pick_dtype("auto", CPU, rows=16)

    assert chosen in (torch.float32, torch.bfloat16, torch.float16)
    line = next(record.getMessage() for record in caplog.records if "dtype auto" in record.getMessage())
    assert line.startswith(f"dtype auto: {_name_of(chosen)} for decode steps of 16 rows")
    assert f"class {cpu_class().name}" in line
    assert "benchmarks/dtype_table.py" in line


def test_auto_dtype_times_nothing_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_arithmetic(*args: object, **kwargs: object) -> None:
        raise AssertionError("--dtype auto must not compute anything to decide")

    for name in ("linear", "scaled_dot_product_attention"):
        monkeypatch.setattr(torch.nn.functional, name, no_arithmetic)
    monkeypatch.setattr(torch, "matmul", no_arithmetic)
    cpu_class.cache_clear()
    try:
        assert pick_dtype("auto", CPU) in DTYPES.values()
    finally:
        cpu_class.cache_clear()


def test_auto_dtype_gives_every_caller_of_a_process_the_same_format() -> None:
    assert len({pick_dtype("auto", CPU) for _ in range(3)}) == 1


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_this_machines_choice_is_the_same_every_time_it_is_worked_out(rows: int) -> None:
    first = auto_dtype(CPU, rows=rows)
    answers = set()
    for _ in range(3):
        cpu_features.cache_clear()
        cpu_class.cache_clear()
        answers.add(auto_dtype(CPU, rows=rows))

    assert answers == {first}


@pytest.mark.parametrize(
    ("features", "machine", "capability", "expected"),
    [
        (SAPPHIRE_RAPIDS, "x86_64", "AVX512", "x86-avx512fp16-amx"),
        (GRANITE_RAPIDS, "x86_64", "AVX512", "x86-avx512fp16-amx"),
        (SAPPHIRE_RAPIDS - {"amx_bf16", "amx_tile"}, "x86_64", "AVX512", "x86-avx512fp16"),
        (EPYC_ZEN4, "x86_64", "AVX512", "x86-avx512bf16"),
        (ICE_LAKE, "x86_64", "AVX512", "x86-avx512"),
        (HASWELL, "x86_64", "AVX2", "x86-avx2"),
        (WESTMERE, "x86_64", "DEFAULT", "x86"),
        (SAPPHIRE_RAPIDS, "x86_64", "AVX2", "x86-avx2"),
        (SAPPHIRE_RAPIDS, "AMD64", "DEFAULT", "x86"),
        (GRAVITON3, "aarch64", "SVE256", "arm-bf16"),
        (CORTEX_A76, "aarch64", "DEFAULT", "arm-fp16"),
        (CORTEX_A72, "aarch64", "DEFAULT", "arm"),
        (frozenset({"vsx"}), "ppc64le", "VSX", "other"),
        (frozenset(), "", "DEFAULT", "other"),
    ],
    ids=[
        "sapphire rapids",
        "granite rapids has at least what sapphire rapids has",
        "avx512-fp16 without amx",
        "amd epyc zen 4",
        "ice lake",
        "haswell",
        "no avx2",
        "a torch capped at avx2 makes an avx2 cpu",
        "a torch without vector kernels makes a plain x86",
        "graviton 3",
        "cortex-a76",
        "cortex-a72",
        "power",
        "nothing known",
    ],
)
def test_a_cpu_falls_in_the_class_its_features_and_torchs_kernels_say(
    features: frozenset[str], machine: str, capability: str, expected: str
) -> None:
    assert classify_cpu(features, machine, capability).name == expected


def choice(features: frozenset[str], rows: int, machine: str = "x86_64", capability: str = "AVX512") -> str:
    return choose_cpu_dtype(classify_cpu(features, machine, capability), rows).name


def test_a_sapphire_rapids_decodes_one_row_in_float16_and_sixteen_in_bfloat16() -> None:
    assert choice(SAPPHIRE_RAPIDS, 1) == "float16"
    assert choice(SAPPHIRE_RAPIDS, 16) == "bfloat16"
    assert choice(GRANITE_RAPIDS, 16) == "bfloat16"


def test_an_amd_epyc_decodes_one_row_in_float16_and_sixteen_in_float32() -> None:
    assert choice(EPYC_ZEN4, 1) == "float16"
    assert choice(EPYC_ZEN4, 16) == "float32"


@pytest.mark.parametrize("rows", [4, 16, 64])
def test_cpus_without_native_half_kernels_decode_one_row_in_float16_and_batches_in_float32(rows: int) -> None:
    assert choice(ICE_LAKE, 1) == "float16"
    assert choice(HASWELL, 1, capability="AVX2") == "float16"
    assert choice(ICE_LAKE, rows) == "float32"
    assert choice(HASWELL, rows, capability="AVX2") == "float32"


@pytest.mark.parametrize("rows", [1, 2, 16, 64])
def test_cpus_that_were_not_measured_keep_float32(rows: int) -> None:
    assert choice(WESTMERE, rows, capability="DEFAULT") == "float32"
    for arm in (GRAVITON3, CORTEX_A76, CORTEX_A72):
        assert choice(arm, rows, machine="aarch64", capability="DEFAULT") == "float32"
    assert choice(frozenset(), rows, machine="riscv64", capability="DEFAULT") == "float32"


def test_a_batch_between_measured_sizes_takes_the_band_below_it() -> None:
    assert choice(SAPPHIRE_RAPIDS, 3) == choice(SAPPHIRE_RAPIDS, 2) == "float32"
    assert choice(SAPPHIRE_RAPIDS, 12) == choice(SAPPHIRE_RAPIDS, 8) == "bfloat16"


@pytest.mark.parametrize("rows", [0, -1])
def test_a_step_of_no_rows_is_refused(rows: int) -> None:
    with pytest.raises(DeviceError, match="rows"):
        choose_cpu_dtype(CpuClass("x86", ()), rows)


def test_every_class_has_bands_from_one_row_up_each_with_its_evidence() -> None:
    assert set(CPU_DTYPE_TABLE) == set(get_args(CpuClassName))
    for name, bands in CPU_DTYPE_TABLE.items():
        starts = [band.min_rows for band in bands]
        assert starts[0] == 1 and starts == sorted(set(starts)), name
        assert all(a.dtype != b.dtype for a, b in pairwise(bands)), name
        assert all(band.dtype in DTYPES and band.evidence for band in bands), name


def test_the_table_gives_what_the_committed_measurements_chose() -> None:
    measured = json.loads(RESULTS.read_text(encoding="utf-8"))["classes"]

    assert measured, "benchmarks/results/dtype_table.json measured no class"
    for name, result in measured.items():
        for rows, expected in result["choice"].items():
            got = choose_cpu_dtype(CpuClass(name, ()), int(rows)).name
            assert got == expected, f"{name} at {rows} rows: table {got}, measured {expected}"


@settings(max_examples=300, deadline=None)
@given(
    features=st.frozensets(st.sampled_from(sorted(GRANITE_RAPIDS | HASWELL | GRAVITON3 | CORTEX_A72))),
    machine=st.sampled_from(["x86_64", "aarch64", "ppc64le"]),
    capability=st.sampled_from(["AVX512", "AVX2", "DEFAULT", "SVE256"]),
    rows=st.integers(1, 256),
)
def test_the_same_hardware_always_gets_the_same_format(
    features: frozenset[str], machine: str, capability: str, rows: int
) -> None:
    first = choose_cpu_dtype(classify_cpu(features, machine, capability), rows)
    again = choose_cpu_dtype(classify_cpu(set(features), machine, capability), rows)

    assert again == first
    assert first.name in DTYPES
    assert first.reason.startswith(first.name)


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((6, 1), "float16"), ((7, 0), "float16"), ((7, 5), "float16"), ((8, 0), "bfloat16"),
     ((8, 6), "bfloat16"), ((8, 9), "bfloat16"), ((9, 0), "bfloat16"), ((10, 0), "bfloat16"),
     ((12, 0), "bfloat16")],
)
def test_a_gpu_gets_bfloat16_from_compute_capability_8_0_and_float16_below(
    capability: tuple[int, int], expected: str
) -> None:
    decided = choose_cuda_dtype(capability, "a GPU")

    assert decided.name == expected
    major, minor = capability
    assert decided.reason.startswith(f"{expected} on a GPU (compute capability {major}.{minor}")


@pytest.mark.parametrize("rows", [1, 16])
def test_auto_dtype_on_cuda_reads_the_capability_of_the_device_asked_for(
    rows: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla T4")

    with caplog.at_level(logging.INFO):
        assert pick_dtype("auto", torch.device("cuda", 1), rows=rows) == torch.float16

    assert asked == [1]
    assert "dtype auto: float16 on Tesla T4 (compute capability 7.5 < 8.0" in caplog.text


def test_cpuinfo_features_are_read_from_the_flags_or_features_line() -> None:
    x86 = ("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu AVX2 avx512_bf16\n\n"
           "processor\t: 1\nflags\t: sse2\n")
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd asimdhp bf16\nCPU implementer\t: 0x41\n"

    assert parse_cpu_features(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert parse_cpu_features(arm) == {"fp", "asimd", "asimdhp", "bf16"}
    assert parse_cpu_features("") == frozenset()


def test_an_unreadable_cpuinfo_means_no_features(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(device_module, "CPUINFO", tmp_path / "missing")
    cpu_features.cache_clear()
    try:
        assert cpu_features() == frozenset()
    finally:
        cpu_features.cache_clear()


def test_chunks_keep_float32_and_cuda_formats_and_this_cpus_native_half_formats() -> None:
    assert chunk_compute_dtype(torch.float32, CPU) == torch.float32
    assert chunk_compute_dtype(torch.float16, torch.device("cuda")) == torch.float16
    assert chunk_compute_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert chunk_compute_dtype(torch.float16, CPU) in (torch.float16, torch.float32)


def _name_of(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)
