"""What a send costs the host once a layout is negotiated: a multi-tensor payload's spec is copied to the device
once per spec, and a message is compared with the negotiated layout, validated in full only when it is the first
or differs (to say what is wrong). Also checks the counter that tests/multiprocess/test_no_sync.py relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_async_pp.runtime import activations, comm
from lightning_async_pp.runtime.comm import Channel
from tests.multiprocess.test_no_sync import count_host_copies

DEVICE = torch.device("cpu")


def test_the_counter_sees_host_to_device_copies_and_nothing_else():
    on_device = torch.zeros(3, device=DEVICE)  # what the runtime allocates on its device
    copies = {
        "torch.tensor": lambda: torch.tensor([1, 2]),
        "torch.as_tensor": lambda: torch.as_tensor([1, 2]),
        "torch.from_numpy": lambda: torch.from_numpy(np.zeros(2)),
        "Tensor.new_tensor": lambda: on_device.new_tensor([1.0]),
        "Tensor.to(device)": lambda: torch.ones(3).to(DEVICE),
        "Tensor.to(device) ": lambda: torch.ones(3).to(on_device.device),
        "Tensor.to(device)  ": lambda: torch.ones(3).to(on_device),
        "Tensor.to(device)   ": lambda: torch.ones(3).to("cpu", torch.float64),
        "Tensor.to(device)    ": lambda: torch.ones(3).to(device=DEVICE, non_blocking=True),
        "Tensor.copy_(host)": lambda: on_device.copy_(torch.ones(3)),
    }
    for name, fn in copies.items():
        counter: dict = {}
        with count_host_copies(counter):
            fn()
        assert counter == {name.strip(): 1}, name
    no_copies = [
        lambda: on_device.to(torch.float64),
        lambda: on_device.to(dtype=torch.int32),
        lambda: on_device.to(torch.float16, True),
        lambda: torch.empty(3).copy_(on_device),  # into host memory (HostFlag): device to host
        lambda: on_device.copy_(on_device * 2),
        lambda: torch.as_tensor(on_device),
        lambda: torch.zeros(3, device=on_device.device).copy_(on_device),
    ]
    for index, fn in enumerate(no_copies):
        counter = {}
        with count_host_copies(counter):
            fn()
        assert counter == {}, index


def test_a_spec_is_copied_to_the_device_once_per_spec():
    value = lambda: (torch.randn(2, requires_grad=True), torch.arange(2))  # noqa: E731
    first, spec = activations.message(value())
    counter: dict = {}
    with count_host_copies(counter):
        again, same = activations.message(value())
    assert counter == {} and same == spec
    assert again[-1] is first[-1] and activations.decode(again[-1]) == spec
    # Another structure has its own spec tensor.
    other, other_spec = activations.message({"h": torch.randn(2), "ids": torch.arange(2, dtype=torch.int16)})
    assert other[-1] is not first[-1] and activations.decode(other[-1]) == other_spec != spec
    assert activations.encoded(spec, DEVICE) is first[-1]


class _Work:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass


def _channel() -> tuple[Channel, list[list[torch.Tensor]]]:
    """A channel that records the tensors it would post instead of posting them."""
    channel = Channel(1, DEVICE, name="test")
    posted: list[list[torch.Tensor]] = []
    channel._op = lambda fn, tensor: tensor
    channel._post = lambda ops: posted.append(ops) or [_Work() for _ in ops]
    return channel, posted


def _message(rows: int = 2) -> list[torch.Tensor]:
    return [torch.randn(rows, 3), torch.zeros(4, dtype=torch.int64)]


def test_a_negotiated_layout_is_compared_not_validated_again(monkeypatch):
    channel, posted = _channel()
    channel.send(_message())
    assert len(posted[-1]) == 3 and posted[-1][0].shape == (comm.HEADER_LEN,)  # the header, then the message
    validated = []
    monkeypatch.setattr(comm, "layout_of", lambda tensors: validated.append(tensors))
    for _ in range(3):
        channel.send(_message())
        assert len(posted[-1]) == 2
    assert validated == []


@pytest.mark.parametrize(
    ("message", "error", "match"),
    [
        (_message(rows=3), RuntimeError, r"changed from \[float32\[2, 3\], int64\[4\]\] to \[float32\[3, 3\], int64"),
        (_message()[:1], RuntimeError, r"changed from .* to \[float32\[2, 3\]\] \(dtype and shape"),
        ([torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.int64)], RuntimeError, "float64"),
        ([torch.zeros(2, 3), torch.zeros(4, dtype=torch.int16)], ValueError, "Cannot send a torch.int16 tensor"),
        ([torch.zeros((1,) * 9), torch.zeros(4, dtype=torch.int64)], ValueError, "at most 8 dimensions"),
        ([torch.zeros(1)] * 33, ValueError, "1 to 32 tensors"),
    ],
)
def test_a_message_that_differs_from_the_layout_is_refused_with_its_error(message, error, match):
    channel, posted = _channel()
    channel.send(_message())
    with pytest.raises(error, match=match):
        channel.send(message)
    assert len(posted) == 1
