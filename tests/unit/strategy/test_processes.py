"""Objects gathered or broadcast between ranks travel through the host, never as pickled device tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_async_pp.strategy import processes
from lightning_async_pp.strategy.processes import PipelineProcesses


class DeviceResident:
    """Stands in for a CUDA tensor on a machine without one: moving it to a device says where it went."""

    def __init__(self, device: str = "cuda:1") -> None:
        self.device = device

    def to(self, device, **_):
        return DeviceResident(str(device))


def _device_values():
    if torch.cuda.is_available():
        return torch.ones(2, device="cuda"), {"w": torch.zeros(1, device="cuda"), "name": "x"}
    return DeviceResident(), {"w": DeviceResident(), "name": "x"}


def _devices(obj) -> list[str]:
    if isinstance(obj, dict):
        return [d for v in obj.values() for d in _devices(v)]
    if isinstance(obj, (tuple, list)):
        return [d for v in obj for d in _devices(v)]
    return [str(obj.device)] if hasattr(obj, "device") else []


def test_gather_stages_sends_host_copies(monkeypatch):
    sent = []

    def gather_object(obj, gathered, dst):
        sent.append(obj)
        gathered[0] = obj

    monkeypatch.setattr(processes.dist, "gather_object", gather_object)
    fake = SimpleNamespace(num_workers=1, is_global_zero=True, num_stages=1, rank_of=lambda stage, replica: 0)
    obj = _device_values()
    (received,) = PipelineProcesses.gather_stages(fake, obj)
    assert _devices(obj) and all(device != "cpu" for device in _devices(obj))
    assert _devices(sent[0]) == ["cpu"] * len(_devices(obj)) and received[1]["name"] == "x"


@pytest.mark.parametrize("root", ["cpu", "cuda:1"])
def test_broadcast_sends_host_copies_and_returns_them_on_this_rank_s_device(monkeypatch, root):
    sent = []
    monkeypatch.setattr(processes, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(processes.dist, "broadcast_object_list", lambda holder, src: sent.append(holder[0]))
    fake = SimpleNamespace(root_device=torch.device(root))
    obj = (DeviceResident("cuda:0"), 3)
    out = PipelineProcesses.broadcast(fake, obj)
    assert _devices(sent[0]) == ["cpu"] and out[1] == 3
    assert _devices(out) == [root]
