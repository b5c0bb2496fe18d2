"""The demo GPT's mixture of experts against a token-by-token computation of the same mixture."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback

from lightning_async_pp.demos.gpt import GPT, MoE
from lightning_async_pp.optim import Muon
from lightning_async_pp.runtime.auxiliary import AuxiliaryLosses
from tests.fixtures.helpers import ROOT, fit, random_batches, tiny_gpt


def moe_layer(coef: float, n_experts: int = 4, k: int = 2, width: int = 8) -> MoE:
    torch.manual_seed(0)
    layer = MoE(width, n_experts, k, coef)
    with torch.no_grad():  # logits far apart enough that no top-k choice is a tie
        layer.router.weight.mul_(20)
    return layer


def token_by_token(layer: MoE, x: torch.Tensor, coef: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixture's output, one token at a time, and ``coef * scale *`` its load-balancing loss."""
    tokens = x.reshape(-1, x.shape[-1])
    n_experts, k = len(layer.experts), layer.experts_per_token
    probs = torch.softmax(tokens @ layer.router.weight.T, dim=-1)
    rows, counts = [], [0] * n_experts
    for token, p in zip(tokens, probs):
        top = sorted(range(n_experts), key=lambda e: -p[e].item())[:k]
        rows.append(sum(p[e] * layer.experts[e](token) for e in top))
        for e in top:
            counts[e] += 1
    share = torch.tensor(counts, dtype=torch.float32) / (len(tokens) * k)
    balance = n_experts * sum(share[e] * probs[:, e].mean() for e in range(n_experts))
    return torch.stack(rows).view_as(x), coef * scale * balance


def grads(layer: MoE) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in layer.named_parameters()}


@pytest.mark.parametrize("k", [1, 2])
def test_the_mixture_and_its_attached_loss_match_a_token_by_token_computation(k):
    coef, scale = 0.3, 0.5  # scale: what a runtime with 2 micro-batches gives each micro-batch's losses
    layer = moe_layer(coef, k=k)
    x = torch.randn(3, 5, 8)
    weight = torch.randn(3, 5, 8)
    with AuxiliaryLosses(scale) as aux:
        y = layer(x)
    (y * weight).sum().backward()
    got = grads(layer)

    layer.zero_grad()
    expected, attached = token_by_token(layer, x, coef, scale)
    ((expected * weight).sum() + attached).backward()
    torch.testing.assert_close(y, expected)
    for name, grad in grads(layer).items():
        torch.testing.assert_close(got[name], grad, msg=lambda m: f"{name}: {m}")
    # The recorded loss is the balance loss itself, without the coefficient or the scale.
    torch.testing.assert_close(aux.total(), attached.detach() / (coef * scale))


def test_the_balance_loss_trains_the_router_and_only_the_router():
    x = torch.randn(2, 6, 8)
    runs = {}
    for coef in (0.0, 0.1):
        layer = moe_layer(coef)
        layer(x).square().sum().backward()
        runs[coef] = grads(layer)
    assert not torch.allclose(runs[0.0]["router.weight"], runs[0.1]["router.weight"])
    for name, grad in runs[0.0].items():
        if name != "router.weight":
            assert torch.equal(grad, runs[0.1][name]), name


def test_every_expert_gets_a_gradient_even_with_no_token():
    layer = moe_layer(0.01)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0].fill_(1.0)
        layer.router.weight[1].fill_(0.5)  # positive inputs: experts 0 and 1 take every token
    layer(torch.rand(2, 4, 8)).sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    assert layer.experts[3][0].weight.grad.abs().sum() == 0 < layer.experts[1][0].weight.grad.abs().sum()


def test_muon_sends_the_routers_to_adamw_and_each_expert_to_muon():
    model = tiny_gpt(n_experts=4, experts_per_token=2)
    optimizer = Muon(model.optimizer_parameters())
    adamw = {n for g in optimizer.param_groups if not g["use_muon"] for n in g["param_names"]}
    muon = {n for g in optimizer.param_groups if g["use_muon"] for n in g["param_names"]}
    assert {"layers.1.mlp.router.weight", "layers.2.mlp.router.weight"} <= adamw
    assert {f"layers.1.mlp.experts.{e}.{i}.weight" for e in range(4) for i in (0, 2)} <= muon
    # A dense model's optimizer gets its named parameters as before.
    dense = tiny_gpt()
    assert [n for n, _ in dense.optimizer_parameters()] == [n for n, _ in dense.named_parameters()]


class BalanceProbe(Callback):
    """Before each step, the balance loss of the step's batch under the weights the step starts from; after
    it, what the step logged."""

    def __init__(self) -> None:
        self.expected: list[float] = []
        self.logged: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with torch.no_grad(), AuxiliaryLosses() as aux:
            pl_module(batch[0])
        self.expected.append(float(aux.total()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(float(trainer.callback_metrics["train/aux_loss"]))


def test_plain_lightning_trains_the_routers_and_logs_the_balance_loss():
    model = tiny_gpt(n_experts=4, experts_per_token=2, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    router = model.layers[1].mlp.router.weight.detach().clone()
    probe = BalanceProbe()
    fit(model, random_batches(3), callbacks=[probe])
    assert not torch.equal(router, model.layers[1].mlp.router.weight)
    # The sum over the two blocks' routers, without the coefficient.
    assert probe.logged == pytest.approx(probe.expected, rel=1e-6)
    assert 1.5 < probe.logged[0] < 3  # about 1 per block when routing is near uniform


@pytest.mark.parametrize(("n_experts", "k"), [(-1, 1), (4, 0), (4, 5)])
def test_an_impossible_mixture_is_refused(n_experts, k):
    with pytest.raises(ValueError, match="experts_per_token between 1 and n_experts"):
        GPT(n_experts=n_experts, experts_per_token=k)


def test_the_example_config_passes_the_cli_validation():
    from lightning_async_pp.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "examples/configs/gpt_moe.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "n_experts: 4" in out.getvalue()


def test_cross_entropy_of_a_mixture_runs_under_bf16_autocast():
    model = tiny_gpt(n_experts=2, experts_per_token=1)
    batch = random_batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(batch[0]).reshape(-1, 256).float(), batch[1].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)


def test_the_plan_command_measures_a_mixture_on_fake_tensors(capsys):
    """The planner traces the model on fake tensors, which hold no values: the routing reads none on the host."""
    import json

    from lightning_async_pp.cli import main

    assert main(["plan", "--config", str(ROOT / "examples/configs/gpt_moe.yaml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = GPT(n_layer=4, n_embd=96, n_head=4, block_size=64, n_experts=4, experts_per_token=2)
    assert report["model"]["parameters"] == sum(p.numel() for p in model.parameters())


def test_the_mixture_makes_no_host_sync_per_steady_state_step():
    """Counted as the dense demo's are (scripts/gpu_check.py, tests/multiprocess/test_no_sync.py): the tensor
    reads that would make the host wait for a GPU, during each step of a 1-stage runtime."""
    from lightning_async_pp.runtime.stage import StageRuntime
    from tests.multiprocess.test_no_sync import count_syncs

    model = tiny_gpt(n_experts=4, experts_per_token=2)
    runtime = StageRuntime(
        kind="2bw", stage=0, num_stages=1, num_microbatches=2, layers=list(model.layers),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), inputs_fn=model.pipeline_inputs,
        loss_fn=model.pipeline_loss, device=torch.device("cpu"),
    )  # fmt: skip
    counts = []
    for step, batch in enumerate(random_batches(4, batch_size=4)):
        counter: dict = {}
        with count_syncs(counter):
            runtime.run_step(step, batch)
        counts.append(counter)
    runtime.drain()
    assert counts[2:] == [{}, {}], counts
