"""``--device`` and ``--dtype`` resolve to a torch device and number format, or to a clear error."""

from __future__ import annotations

import logging

import pytest
import torch

from services.node.device import DeviceError, pick_device, pick_dtype

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
