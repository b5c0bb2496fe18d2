"""CUDA_DEVICE_MAX_CONNECTIONS=1 with NCCL is warned about once, with the reason; nothing else is."""

from __future__ import annotations

import warnings

import pytest

from lightning_async_pp.strategy.device_sync import warn_unsafe_device_settings


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_one_hardware_queue_with_nccl_is_warned_about(monkeypatch, backend):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.warns(UserWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=1 is set.*pending across steps.*Unset it"):
        warn_unsafe_device_settings(backend, multi_process=True)


@pytest.mark.parametrize(
    ("value", "backend", "multi_process"),
    [("1", "gloo", True), ("1", "nccl", False), ("8", "nccl", True), (None, "nccl", True), ("1", None, True)],
)
def test_other_settings_are_not(monkeypatch, value, backend, multi_process):
    if value is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unsafe_device_settings(backend, multi_process)
