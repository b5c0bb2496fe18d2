"""When UpdateDriver posts and waits for the average over replicas, with torch.distributed recorded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_async_pp.runtime import updates
from lightning_async_pp.runtime.replicas import ReplicaAverage
from lightning_async_pp.runtime.updates import UpdateDriver
from lightning_async_pp.runtime.weights import WeightVersions


class TwoEqualReplicas:
    """An all-reduce over two replicas holding the same gradient: SUM doubles it; posts and waits are logged."""

    def __init__(self, log: list) -> None:
        self.log = log

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        assert async_op and op == torch.distributed.ReduceOp.SUM  # gloo: no AVG
        self.log.append(("post", group, tensor.numel()))
        tensor.mul_(2)
        return SimpleNamespace(wait=lambda: self.log.append(("wait", group)))


def make_driver(monkeypatch, log, **options):
    monkeypatch.setattr(updates.dist, "all_reduce", TwoEqualReplicas(log).all_reduce)
    monkeypatch.setattr(updates.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(updates.dist, "get_backend", lambda group=None: "gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    params = dict(model.named_parameters())
    weights = WeightVersions(params, num_buffers=2)
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    driver = UpdateDriver(optimizer, weights, "2bw", 1, torch.device("cpu"), data_group="data", **options)
    driver.replicas = ReplicaAverage("data", bucket_bytes=40 * 4)  # 8x8 alone, then 8 + 16 + 2
    return model, weights, driver


def backward(model, weights, step):
    out = torch.func.functional_call(model, weights.pin(step, step - 1), (torch.randn(4, 8),))
    out.pow(2).sum().backward()


def test_average_is_posted_at_update_in_buckets_and_waited_where_the_version_is_needed(monkeypatch):
    log: list = []
    model, weights, driver = make_driver(monkeypatch, log)
    backward(model, weights, 0)
    grads = {n: t.grad.clone() for n, t in weights.of(-1).items()}
    before = {n: p.detach().clone() for n, p in weights.params.items()}
    driver.start(0)
    assert log == [("post", "data", 64), ("post", "data", 26)]  # two buckets, nothing waited
    assert len(driver.pending) == 1 and weights.newest == 0
    assert all(torch.equal(p, before[n]) for n, p in weights.params.items())  # not applied yet
    driver.complete(up_to_version=0)
    assert len(log) == 2  # version 0 needs nothing
    driver.complete(up_to_version=1)  # the first forward on version 1
    assert log[2:] == [("wait", "data"), ("wait", "data")] and weights.newest == 1
    for name, param in weights.params.items():  # the average of two equal gradients is the gradient
        assert torch.equal(param, before[name].add(grads[name], alpha=-0.1)), name


def test_next_update_applies_a_pending_average_before_reusing_its_buckets(monkeypatch):
    log: list = []
    model, weights, driver = make_driver(monkeypatch, log)
    backward(model, weights, 0)
    driver.start(0)
    backward(model, weights, 1)  # 2BW's last stage: step 1's update comes before version 1 is needed
    driver.start(1)
    assert [entry[0] for entry in log] == ["post", "post", "wait", "wait", "post", "post"]
    assert [p.step for p in driver.pending] == [1] and weights.newest == 1


@pytest.mark.parametrize("option", ["clip_grad_norm", "before_update"])
def test_average_is_waited_at_once_where_the_update_needs_it_at_update(monkeypatch, option):
    """The clipping norm and the hook need the averaged gradient at UPDATE."""
    log: list = []
    seen = []
    value = 1.0 if option == "clip_grad_norm" else lambda: seen.append(len(log))
    model, weights, driver = make_driver(monkeypatch, log, **{option: value})
    backward(model, weights, 0)
    driver.start(0)
    assert log == [("post", "data", 64), ("post", "data", 26), ("wait", "data"), ("wait", "data")]
    if option == "before_update":
        assert seen == [4]
