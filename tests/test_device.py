"""``--device`` and ``--dtype`` resolve to a torch device and number format, or to a clear error."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.node.device import (
    DeviceError,
    DTypeName,
    FormatCost,
    choose_cpu_dtype,
    chunk_compute_dtype,
    measure_cpu_costs,
    pick_device,
    pick_dtype,
)

CPU = torch.device("cpu")


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


def test_auto_dtype_on_the_cpu_is_measured_explained_and_leaves_the_threads_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO):
        chosen = pick_dtype("auto", CPU)

    assert chosen in (torch.float32, torch.bfloat16, torch.float16)
    assert "dtype auto" in caplog.text
    assert all(name in caplog.text for name in ("float16", "bfloat16", "float32"))
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("name", ["fp8", "half", "int8"])
def test_an_unknown_dtype_is_refused_naming_the_choices(name: str) -> None:
    with pytest.raises(DeviceError, match="use auto, float32, bfloat16 or float16"):
        pick_dtype(name, CPU)


def test_auto_dtype_gives_every_caller_of_a_process_the_same_format() -> None:
    assert len({pick_dtype("auto", CPU) for _ in range(3)}) == 1


def test_repeated_measurements_of_this_cpu_lead_to_the_same_choice() -> None:
    assert len({choose_cpu_dtype(measure_cpu_costs()).name for _ in range(3)}) == 1


# Machine profiles as speeds relative to float32 (decode, prompt); a cost is the inverse of a speed.
Profile = dict[DTypeName, tuple[float, float]]
EPYC: Profile = {"float32": (1.0, 1.0), "float16": (2.5, 0.95), "bfloat16": (1.27, 2.3)}
"""This development machine (AMD EPYC, avx512_bf16), float16 chunks computed in float32."""
EPYC_NATIVE_FLOAT16_PROMPTS: Profile = {
    "float32": (1.0, 1.0),
    "float16": (2.5, 0.24),
    "bfloat16": (1.27, 2.3),
}
"""The same machine if float16 prompts ran through torch's generic float16 kernels."""
XEON: Profile = {"float32": (1.0, 1.0), "float16": (0.8, 0.9), "bfloat16": (1.1, 1.8)}
"""A CPU on which float32 decodes about as fast as anything."""
BF16_CPU: Profile = {"float32": (1.0, 1.0), "float16": (1.6, 0.9), "bfloat16": (3.0, 3.0)}
"""A CPU with fast bfloat16 kernels, on which float16 only streams fewer bytes."""


def costs_of(profile: Profile, noise: dict[str, float] | None = None) -> dict[DTypeName, FormatCost]:
    factor = noise or {}
    return {
        name: FormatCost(
            decode=factor.get(f"{name} decode", 1.0) / decode,
            prompt=factor.get(f"{name} prompt", 1.0) / prompt,
        )
        for name, (decode, prompt) in profile.items()
    }


@pytest.mark.parametrize(
    ("profile", "expected"),
    [(EPYC, "float16"), (EPYC_NATIVE_FLOAT16_PROMPTS, "float32"), (XEON, "float32"), (BF16_CPU, "bfloat16")],
    ids=["epyc", "epyc with slow float16 prompts", "xeon", "fast bfloat16"],
)
def test_the_rule_picks_a_half_format_only_when_it_is_clearly_faster(profile: Profile, expected: str) -> None:
    choice = choose_cpu_dtype(costs_of(profile))

    assert choice.name == expected
    assert (
        choice.dtype
        == {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[expected]
    )
    assert choice.reason.startswith(expected)
    assert "float16 decodes" in choice.reason and "bfloat16 decodes" in choice.reason


def test_a_half_format_just_short_of_the_margin_leaves_float32_in_place() -> None:
    profile: Profile = {"float32": (1.0, 1.0), "float16": (1.45, 1.0), "bfloat16": (1.4, 1.5)}

    assert choose_cpu_dtype(costs_of(profile)).name == "float32"


def test_bfloat16_replaces_float16_only_when_it_decodes_clearly_faster_than_float16() -> None:
    close: Profile = {"float32": (1.0, 1.0), "float16": (2.0, 1.0), "bfloat16": (2.4, 2.0)}
    clear: Profile = {"float32": (1.0, 1.0), "float16": (2.0, 1.0), "bfloat16": (2.6, 2.0)}

    assert choose_cpu_dtype(costs_of(close)).name == "float16"
    assert choose_cpu_dtype(costs_of(clear)).name == "bfloat16"


def test_a_format_this_cpu_cannot_run_is_never_chosen() -> None:
    costs = costs_of(EPYC)
    costs["float16"] = FormatCost(decode=float("inf"), prompt=float("inf"))

    choice = choose_cpu_dtype(costs)

    assert choice.name == "float32"
    assert "float16 decodes 0.00x" in choice.reason


NOISE_KEYS = [
    f"{name} {kind}" for name in ("float32", "float16", "bfloat16") for kind in ("decode", "prompt")
]


@settings(max_examples=300, deadline=None)
@given(
    profile=st.sampled_from([EPYC, XEON, BF16_CPU]),
    noise=st.fixed_dictionaries({key: st.floats(0.85, 1.15) for key in NOISE_KEYS}),
)
def test_measurement_noise_of_fifteen_percent_never_flips_the_choice(
    profile: Profile, noise: dict[str, float]
) -> None:
    assert choose_cpu_dtype(costs_of(profile, noise)).name == choose_cpu_dtype(costs_of(profile)).name


def test_chunks_keep_float32_and_cuda_formats_and_this_cpus_native_half_formats() -> None:
    assert chunk_compute_dtype(torch.float32, CPU) == torch.float32
    assert chunk_compute_dtype(torch.float16, torch.device("cuda")) == torch.float16
    assert chunk_compute_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert chunk_compute_dtype(torch.float16, CPU) in (torch.float16, torch.float32)
