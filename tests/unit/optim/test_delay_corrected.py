"""`lightning_async_pp.optim.DelayCorrected` against closed forms and a hand-written reference."""

from __future__ import annotations

import collections
import copy
import io
import pickle
import weakref
from functools import partial

import pytest
import torch
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI, OptimizerCallable
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_async_pp.optim import DelayCorrected, Muon

LR = 0.1


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (4, 8), (5,), (8,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(params, step: int) -> None:
    """Gradients that depend on the weights, so any difference in the update shows up later as well."""
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = param.detach() * 0.3 + torch.randn(param.shape, generator=generator)


def muon_factory(params):
    return Muon(params, lr=0.05, weight_decay=0.1, adamw_lr=0.01, adamw_weight_decay=0.1)


def adamw_factory(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def reference_trajectory(params, base_factory, coefficient: float, steps: int, lr_at=None):
    """Runs an independent base optimizer, records each update it makes and applies the correction."""
    base = base_factory(params)
    previous = None
    for step in range(steps):
        if lr_at is not None:
            for group in base.param_groups:
                group["lr"] = lr_at(step, group["initial_lr"])
        set_grads(params, step)
        before = [p.detach().clone() for p in params]
        base.step()
        with torch.no_grad():
            update = [b - p for b, p in zip(before, params)]
            if previous is not None:
                for p, u, u_prev in zip(params, update, previous):
                    p.sub_(coefficient * (u - u_prev))
        previous = update
    return params


def run(params, optimizer, steps, scheduler=None):
    for step in steps:
        set_grads(params, step)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("coefficient", [1.0, 0.5])
def test_sgd_matches_closed_form(coefficient):
    """w[t+1] = w[t] - (1 + c) lr g[t] + c lr g[t-1]; the first step is plain SGD."""
    generator = torch.Generator().manual_seed(3)
    grads = [[torch.randn(shape, generator=generator) for shape in [(3, 2), (4,)]] for _ in range(6)]
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(3, 2), (4,)]]
    expected = [p.detach().double().clone() for p in params]
    optimizer = DelayCorrected(torch.optim.SGD(params, lr=LR), coefficient=coefficient)

    for step, step_grads in enumerate(grads):
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()
        for i, grad in enumerate(step_grads):
            expected[i] -= (1 + coefficient) * LR * grad.double() if step else LR * grad.double()
            if step:
                expected[i] += coefficient * LR * grads[step - 1][i].double()
        for param, value in zip(params, expected):
            torch.testing.assert_close(param.detach().double(), value, atol=1e-6, rtol=0)


@pytest.mark.parametrize("coefficient", [1.0, 0.5])
@pytest.mark.parametrize("base", [adamw_factory, muon_factory], ids=["adamw", "muon"])
def test_matches_reference_over_adamw_and_muon(base, coefficient):
    params = make_params()
    expected = reference_trajectory(clone_params(params), base, coefficient, steps=10)
    optimizer = DelayCorrected(base(params), coefficient=coefficient)
    run(params, optimizer, range(10))
    plain = make_params()
    run(plain, base(plain), range(10))
    for ours, ref, uncorrected in zip(params, expected, plain):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
        assert not torch.allclose(ours, uncorrected, atol=1e-4), "the correction had no effect"


@pytest.mark.parametrize("base", [adamw_factory, muon_factory], ids=["adamw", "muon"])
def test_coefficient_zero_is_the_base_optimizer_bitwise(base):
    params, plain = make_params(), make_params()
    run(params, DelayCorrected(base(params), coefficient=0.0), range(5))
    run(plain, base(plain), range(5))
    for ours, ref in zip(params, plain):
        assert torch.equal(ours, ref)


def test_factory_form_builds_the_base_optimizer():
    params = make_params()
    optimizer = DelayCorrected(params, base=partial(torch.optim.SGD, lr=LR), coefficient=0.5)
    assert isinstance(optimizer.base_optimizer, torch.optim.SGD)
    assert optimizer.param_groups is optimizer.base_optimizer.param_groups
    assert optimizer.state is optimizer.base_optimizer.state
    assert optimizer.defaults is optimizer.base_optimizer.defaults
    default = DelayCorrected(make_params())
    assert type(default.base_optimizer) is torch.optim.AdamW
    assert default.coefficient == 1.0


def test_invalid_arguments_are_refused():
    params = make_params()
    with pytest.raises(ValueError, match="coefficient.*>= 0"):
        DelayCorrected(torch.optim.SGD(params, lr=LR), coefficient=-0.5)
    with pytest.raises(ValueError, match="either an optimizer"):
        DelayCorrected(torch.optim.SGD(params, lr=LR), base=torch.optim.AdamW)
    with pytest.raises(TypeError, match="returned a list"):
        DelayCorrected(params, base=list)
    with pytest.raises(ValueError, match="already a `DelayCorrected`"):
        DelayCorrected(DelayCorrected(torch.optim.SGD(params, lr=LR)))


def test_closure_is_called_exactly_once_and_its_result_returned():
    params = make_params()
    optimizer = DelayCorrected(torch.optim.SGD(params, lr=LR))
    calls = []

    def closure():
        calls.append(1)
        set_grads(params, 0)
        return torch.tensor(2.5)

    for _ in range(2):
        assert optimizer.step(closure) == 2.5
    assert len(calls) == 2


def test_parameters_without_gradient_are_left_alone():
    params = make_params()
    frozen = params[2]
    before = frozen.detach().clone()
    optimizer = DelayCorrected(torch.optim.AdamW(params, lr=0.01))
    for step in range(3):
        set_grads(params, step)
        frozen.grad = None
        optimizer.step()
    assert torch.equal(frozen, before)
    assert "previous_update" not in optimizer.state[frozen]


def test_lr_scheduler_through_the_wrapper_matches_closed_form():
    """SGD with lr[t]: w[t+1] = w[t] - 2 lr[t] g[t] + lr[t-1] g[t-1]."""
    generator = torch.Generator().manual_seed(4)
    grads = [torch.randn(5, generator=generator) for _ in range(5)]
    param = torch.nn.Parameter(torch.randn(5, generator=generator))
    expected = param.detach().double().clone()
    optimizer = DelayCorrected(torch.optim.SGD([param], lr=LR))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    for step, grad in enumerate(grads):
        param.grad = grad.clone()
        optimizer.step()
        scheduler.step()
        lr, previous_lr = LR * 0.5**step, LR * 0.5 ** (step - 1)
        expected -= 2 * lr * grad.double() - previous_lr * grads[step - 1].double() if step else lr * grad.double()
        torch.testing.assert_close(param.detach().double(), expected, atol=1e-6, rtol=0)


def test_lr_scheduler_reaches_both_muon_parts_through_the_wrapper():
    def lr_at(step, base):
        return base / (1 + step)

    params = make_params()
    reference_params = clone_params(params)

    def scheduled_reference(params):
        optimizer = muon_factory(params)
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
        return optimizer

    expected = reference_trajectory(reference_params, scheduled_reference, 1.0, steps=6, lr_at=lr_at)
    optimizer = DelayCorrected(params, base=muon_factory)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    run(params, optimizer, range(6), scheduler)
    for ours, ref in zip(params, expected):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("base", [adamw_factory, muon_factory], ids=["adamw", "muon"])
def test_state_dict_round_trip_continues_bitwise(base):
    params = make_params()
    optimizer = DelayCorrected(base(params))
    run(params, optimizer, range(3))
    state_dict = optimizer.state_dict()
    assert all("previous_update" in state for state in state_dict["state"].values())

    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    resumed_params = clone_params(params)
    resumed = DelayCorrected(base(resumed_params))
    resumed.load_state_dict(torch.load(buffer))

    run(params, optimizer, range(3, 8))
    run(resumed_params, resumed, range(3, 8))
    for ours, ref in zip(params, resumed_params):
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("base", [adamw_factory, muon_factory], ids=["adamw", "muon"])
def test_one_previous_update_per_parameter_and_the_last_one_released(base):
    """Each step's snapshot becomes the parameter's buffer: the state never holds more than one, and the
    buffer it replaces is freed rather than kept alive by anything the step made."""
    params = make_params()
    optimizer = DelayCorrected(base(params))
    run(params, optimizer, range(1))
    for step in range(1, 4):
        released = [weakref.ref(optimizer.state[p]["previous_update"]) for p in params]
        run(params, optimizer, range(step, step + 1))
        assert all(ref() is None for ref in released)
        for p in params:
            buffer = optimizer.state[p]["previous_update"]
            assert buffer.shape == p.shape and buffer.untyped_storage().nbytes() == p.numel() * p.element_size()
        del buffer


def test_copies_share_nothing_with_the_original():
    params = make_params()
    optimizer = DelayCorrected(torch.optim.AdamW(params, lr=0.01))
    run(params, optimizer, range(2))
    for copied in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        assert copied.param_groups is copied.base_optimizer.param_groups
        assert copied.coefficient == 1.0
        assert "DelayCorrected(coefficient=1.0" in repr(copied)
        copied.param_groups[0]["lr"] = 0.0
    assert optimizer.param_groups[0]["lr"] == 0.01


YAML_CORRECTED_ADAMW = """
optimizer:
  class_path: lightning_async_pp.optim.DelayCorrected
  init_args:
    base:
      class_path: torch.optim.AdamW
      init_args: {lr: 0.001}
    coefficient: 1.0
"""

YAML_CORRECTED_MUON = """
optimizer:
  class_path: lightning_async_pp.optim.DelayCorrected
  init_args:
    base:
      class_path: lightning_async_pp.optim.Muon
      init_args:
        lr: 0.02
        adjust_lr_fn: match_rms_adamw
        adamw_lr: 0.001
    coefficient: 0.5
"""

YAML_MUON = """
optimizer:
  class_path: lightning_async_pp.optim.Muon
  init_args:
    lr: 0.02
    weight_decay: 0.1
    adamw_lr: 0.0003
    adamw_betas: [0.9, 0.95]
    adamw_patterns: ["*embed*", "*lm_head*"]
"""


def parse_optimizer_callable(yaml: str):
    parser = ArgumentParser()
    parser.add_argument("--optimizer", type=OptimizerCallable)
    return parser.instantiate(parser.parse_string(yaml)).optimizer


def named_model_parameters():
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(7, 4), "fc": torch.nn.Linear(4, 4)})
    return model.named_parameters()


def test_yaml_forms_through_jsonargparse():
    corrected_adamw = parse_optimizer_callable(YAML_CORRECTED_ADAMW)(named_model_parameters())
    assert isinstance(corrected_adamw, DelayCorrected) and corrected_adamw.coefficient == 1.0
    assert type(corrected_adamw.base_optimizer) is torch.optim.AdamW
    assert corrected_adamw.param_groups[0]["lr"] == 0.001

    corrected_muon = parse_optimizer_callable(YAML_CORRECTED_MUON)(named_model_parameters())
    assert corrected_muon.coefficient == 0.5 and isinstance(corrected_muon.base_optimizer, Muon)
    muon_group, adamw_group = corrected_muon.param_groups
    assert muon_group["param_names"] == ["fc.weight"] and muon_group["adjust_lr_fn"] == "match_rms_adamw"
    assert muon_group["lr"] == 0.02 and adamw_group["lr"] == 0.001

    muon = parse_optimizer_callable(YAML_MUON)(named_model_parameters())
    assert isinstance(muon, Muon) and muon.adamw_patterns == ("*embed*", "*lm_head*")
    assert [g["param_names"] for g in muon.param_groups] == [["fc.weight"], ["embed.weight", "fc.bias"]]
    assert muon.param_groups[1]["betas"] == (0.9, 0.95)


class TinyModel(LightningModule):
    def __init__(self, optimizer: OptimizerCallable | None = None):
        super().__init__()
        self.optimizer_factory = optimizer
        self.embed = torch.nn.Embedding(7, 4)
        self.fc = torch.nn.Linear(4, 7)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.fc(self.embed(batch)), batch)

    def configure_optimizers(self):
        return self.optimizer_factory(self.named_parameters())


def test_trains_inside_lightning_from_a_lightning_cli_config(tmp_path):
    """The demo's pattern: the model takes an `OptimizerCallable` and calls it on `named_parameters()`."""
    config = tmp_path / "config.yaml"
    config.write_text("model:" + YAML_CORRECTED_MUON.replace("\n", "\n  "))
    cli = LightningCLI(
        TinyModel,
        run=False,
        args=["--config", str(config)],
        save_config_callback=None,
        trainer_defaults={"default_root_dir": str(tmp_path)},
    )
    model = cli.model
    before = model.fc.weight.detach().clone()
    trainer = Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, torch.utils.data.DataLoader(torch.randint(0, 7, (12,)), batch_size=4))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, DelayCorrected) and isinstance(optimizer.base_optimizer, Muon)
    assert "previous_update" in optimizer.state[model.fc.weight]
    assert not torch.equal(model.fc.weight, before)


def test_named_parameters_reach_the_base_optimizer_with_their_names():
    """The factory form hands ``named_parameters()`` pairs to ``base`` as they are, and the docstring says so."""
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(16, 8), "fc": torch.nn.Linear(8, 8)})
    received = []

    def base(params):
        params = list(params)
        received.extend(params)
        return Muon(params, lr=0.02)

    optimizer = DelayCorrected(model.named_parameters(), base=base)
    assert [name for name, _ in received] == [name for name, _ in model.named_parameters()]
    routed = {name: group["use_muon"] for group in optimizer.param_groups for name in group["param_names"]}
    assert routed == {"embed.weight": False, "fc.weight": True, "fc.bias": False}
    params_doc = DelayCorrected.__doc__.split("params:", 1)[1].split("base:", 1)[0]
    assert "named_parameters()" in params_doc and "base optimizer" in params_doc


# --- coefficient="auto" ------------------------------------------------------------------------------------


def sgd_with_lr_factors(grads_at, factors, coefficient, lr=LR):
    """Runs corrected SGD with lr[t] = lr * factors[t] and gradients grads_at(t); returns the weights per step."""
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    optimizer = DelayCorrected(torch.optim.SGD([param], lr=lr), coefficient=coefficient)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factors[step] if step < len(factors) else 0)
    weights = []
    for step in range(len(factors)):
        param.grad = grads_at(step).clone()
        optimizer.step()
        scheduler.step()
        weights.append(param.detach().clone())
    return optimizer, param, weights


GRAD = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)


@pytest.mark.parametrize("ratio", [0.8, 0.5])
def test_auto_with_geometric_updates_is_one_update_ahead(ratio):
    """u[t] = r u[t-1] (r < 1): c = r from the second step, so w[t+1] is the uncorrected w[t+2] exactly."""
    factors = [ratio**t for t in range(8)]
    optimizer, param, weights = sgd_with_lr_factors(lambda t: GRAD, factors, "auto")
    uncorrected = [-LR * GRAD * sum(ratio**k for k in range(t + 1)) for t in range(len(factors) + 1)]
    torch.testing.assert_close(weights[0], uncorrected[0])  # the first step is plain
    for t in range(1, len(factors)):
        torch.testing.assert_close(weights[t], uncorrected[t + 1], atol=1e-12, rtol=0)
    state = optimizer.state[param]
    torch.testing.assert_close(state["lookahead"].double(), torch.tensor(ratio, dtype=torch.float64))


def test_auto_with_growing_updates_is_capped_at_one():
    """u[t] = 1.5 u[t-1]: the slope 1.5 is capped at c = 1, i.e. w[t+1] = v[t+1] - u[t]."""
    factors = [1.5**t for t in range(6)]
    optimizer, param, weights = sgd_with_lr_factors(lambda t: GRAD, factors, "auto")
    for t in range(1, len(factors)):
        uncorrected = -LR * GRAD * sum(factors[: t + 1])
        torch.testing.assert_close(weights[t], uncorrected - LR * GRAD * factors[t], atol=1e-12, rtol=0)
    assert float(optimizer.state[param]["lookahead"]) == 1.0


def test_auto_with_constant_updates_equals_coefficient_one_after_the_first_steps():
    """Constant updates: c = 1, the paper's correction, except that the first step's update is not undone."""
    factors = [1.0] * 6
    _, _, auto = sgd_with_lr_factors(lambda t: GRAD, factors, "auto")
    _, _, fixed = sgd_with_lr_factors(lambda t: GRAD, factors, 1.0)
    for t in range(1, len(factors)):
        torch.testing.assert_close(auto[t], -LR * GRAD * (t + 2), atol=1e-12, rtol=0)
        # c = 1 subtracts u[t] - u[t-1] = 0 after the plain first step: it never gets ahead.
        torch.testing.assert_close(fixed[t], -LR * GRAD * (t + 1), atol=1e-12, rtol=0)


def test_auto_with_oscillating_updates_is_the_base_optimizer():
    """u[t] = -u[t-1]: the updates predict their successor's sign wrongly, c = 0, plain SGD exactly."""
    _, _, auto = sgd_with_lr_factors(lambda t: GRAD * (-1) ** t, [1.0] * 6, "auto")
    _, _, plain = sgd_with_lr_factors(lambda t: GRAD * (-1) ** t, [1.0] * 6, 0.0)
    for ours, ref in zip(auto, plain):
        torch.testing.assert_close(ours, ref, atol=1e-12, rtol=0)


def test_auto_closed_form_with_random_gradients_per_tensor():
    """Each tensor has its own running averages and coefficient (checked against the rule in float64)."""
    generator = torch.Generator().manual_seed(5)
    steps, decay = 8, 0.9
    shapes = [(3, 2), (4,), (5,)]
    grads = [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes] for _ in range(steps)]
    for g in grads:  # positively correlated updates for the first two tensors, not for the third
        g[0] += 2.0
        g[1] += 1.0
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64)) for shape in shapes]
    optimizer = DelayCorrected(
        torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.3}], lr=LR), coefficient="auto"
    )
    lrs = [LR, LR, 0.3]
    expected = [torch.zeros_like(p) for p in params]
    averages = [[0.0, 0.0] for _ in params]
    lookahead = [0.0 for _ in params]
    for step in range(steps):
        for param, grad in zip(params, grads[step]):
            param.grad = grad.clone()
        optimizer.step()
        for i in range(len(params)):
            update = lrs[i] * grads[step][i]
            if step == 0:
                expected[i] -= update
                continue
            previous = lrs[i] * grads[step - 1][i]
            averages[i] = [
                decay * averages[i][0] + (1 - decay) * float((update * previous).sum()),
                decay * averages[i][1] + (1 - decay) * float((previous * previous).sum()),
            ]
            c = min(max(averages[i][0] / averages[i][1], 0.0), 1.0)
            expected[i] += -update - c * update + lookahead[i] * previous
            lookahead[i] = c
        for param, value in zip(params, expected):
            torch.testing.assert_close(param.detach(), value, atol=1e-12, rtol=0)
    assert min(lookahead[:2]) > 0.3 and lookahead[2] < min(lookahead[:2])
    for param, c in zip(params, lookahead):
        assert float(optimizer.state[param]["lookahead"]) == pytest.approx(c, abs=1e-12)


@pytest.mark.parametrize("base", [adamw_factory, muon_factory], ids=["adamw", "muon"])
def test_auto_state_dict_round_trip_continues_bitwise(base):
    params = make_params()
    optimizer = DelayCorrected(base(params), coefficient="auto")
    run(params, optimizer, range(3))
    state_dict = optimizer.state_dict()
    for state in state_dict["state"].values():
        assert {"previous_update", "lookahead", "update_alignment", "update_square"} <= set(state)

    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    resumed_params = clone_params(params)
    resumed = DelayCorrected(base(resumed_params), coefficient="auto")
    resumed.load_state_dict(torch.load(buffer))

    run(params, optimizer, range(3, 8))
    run(resumed_params, resumed, range(3, 8))
    plain = make_params()
    run(plain, base(plain), range(8))
    for ours, ref, uncorrected in zip(params, resumed_params, plain):
        assert torch.equal(ours, ref)
        assert not torch.allclose(ours, uncorrected, atol=1e-4), "the correction had no effect"


@pytest.mark.parametrize("base", [adamw_factory, muon_factory], ids=["adamw", "muon"])
def test_auto_keeps_one_parameter_sized_buffer(base):
    params, fixed_params = make_params(), make_params()
    optimizer = DelayCorrected(base(params), coefficient="auto")
    plain = DelayCorrected(base(fixed_params), coefficient=1.0)

    def sizes(opt):
        return sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1)

    run(params, optimizer, range(4))
    run(fixed_params, plain, range(4))
    assert sizes(optimizer) == sizes(plain)
    assert all(optimizer.state[p]["lookahead"].dim() == 0 for p in params)


def test_auto_is_refused_misspelt():
    with pytest.raises(ValueError, match="'auto'"):
        DelayCorrected(torch.optim.SGD(make_params(), lr=LR), coefficient="Auto")


def research_factory(name):
    """SOAP and Adan from the `research` extra (pytorch-optimizer)."""
    pytorch_optimizer = pytest.importorskip(
        "pytorch_optimizer", reason='SOAP and Adan come from the `research` extra: pip install -e ".[research]"'
    )
    if name == "soap":
        return lambda params: pytorch_optimizer.SOAP(params, lr=0.01, weight_decay=0.1, precondition_frequency=2)
    return lambda params: pytorch_optimizer.Adan(params, lr=0.01, weight_decay=0.02)


@pytest.mark.parametrize("coefficient", [1.0, "auto"])
@pytest.mark.parametrize("name", ["soap", "adan"])
def test_research_optimizers_match_reference(name, coefficient):
    """SOAP and Adan under the wrapper: c = 1 against the hand-written reference, "auto" against c = 0."""
    base = research_factory(name)
    params = make_params()
    optimizer = DelayCorrected(base(params), coefficient=coefficient)
    run(params, optimizer, range(10))
    plain = make_params()
    run(plain, base(plain), range(10))
    if coefficient == 1.0:
        expected = reference_trajectory(make_params(), base, 1.0, steps=10)
        for ours, ref in zip(params, expected):
            torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    for ours, uncorrected in zip(params, plain):
        assert not torch.allclose(ours, uncorrected, atol=1e-4), "the correction had no effect"
    assert all(0 <= float(optimizer.state[p].get("lookahead", 0)) <= 1 for p in params)


class PerTensorReference:
    """The correction written out per parameter, with no multi-tensor arithmetic: the specification the
    wrapper's grouped ``torch._foreach_*`` path must reproduce, bit for bit for a fixed coefficient. For
    ``"auto"``, inner products and norms are taken directly in float64 and the correction is added to the weights
    in one rounding. The state it keeps is the documented format."""

    def __init__(self, base: torch.optim.Optimizer, coefficient: float | str) -> None:
        self.base, self.coefficient = base, coefficient

    @torch.no_grad()
    def step(self) -> None:
        params = [p for group in self.base.param_groups for p in group["params"] if p.grad is not None]
        before = [p.clone() for p in params]
        self.base.step()
        for param, snapshot in zip(params, before):
            state = self.base.state[param]
            update = snapshot - param
            previous = state.get("previous_update")
            if self.coefficient != "auto":
                if previous is not None:
                    param.add_(previous - update, alpha=self.coefficient)
            elif previous is None:
                state["lookahead"] = torch.zeros(())
            else:
                u, p = update.double(), previous.double()
                a = 0.9 * float(state.get("update_alignment", 0.0)) + 0.1 * float((u * p).sum())
                b = 0.9 * float(state.get("update_square", 0.0)) + 0.1 * float((p * p).sum())
                c = min(max(a / b, 0.0), 1.0) if b > 0 else 0.0
                param.copy_(param.double() + float(state.get("lookahead", 0.0)) * p - c * u)
                state["lookahead"], state["update_alignment"], state["update_square"] = map(torch.tensor, (c, a, b))
            state["previous_update"] = update


MIXED = [
    ((6, 4), torch.float32),
    ((4, 8), torch.bfloat16),
    ((5,), torch.float64),
    ((3, 2, 2), torch.float32),
    ((7,), torch.bfloat16),
    ((1,), torch.float32),
]


def mixed_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape, dtype in MIXED]


def set_mixed_grads(params, step: int, skip: int | None = None) -> None:
    generator = torch.Generator().manual_seed(200 + step)
    for i, param in enumerate(params):
        grad = param.detach().float() * 0.3 + torch.randn(param.shape, generator=generator)
        param.grad = None if i == skip else grad.to(param.dtype)


@pytest.mark.parametrize("coefficient", [1.0, 0.7])
@pytest.mark.parametrize("base", [adamw_factory, partial(torch.optim.SGD, lr=0.05, momentum=0.9)], ids=["adamw", "sgd"])
def test_grouped_path_equals_per_tensor_reference_bitwise(base, coefficient):
    """Several shapes and dtypes in one optimizer, a parameter that joins late, and a save/load in the middle."""
    params, ref_params = mixed_params(), mixed_params()
    optimizer = DelayCorrected(base(params), coefficient=coefficient)
    reference = PerTensorReference(base(ref_params), coefficient)
    for step in range(4):  # parameter 2 has no gradient in the first steps: it starts its correction later
        for ps in (params, ref_params):
            set_mixed_grads(ps, step, skip=2 if step < 2 else None)
        optimizer.step()
        reference.step()

    # Round trip through a state dict into a fresh wrapper over fresh copies of the weights.
    saved = io.BytesIO()
    torch.save(optimizer.state_dict(), saved)
    saved.seek(0)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = DelayCorrected(base(resumed), coefficient=coefficient)
    optimizer.load_state_dict(torch.load(saved))
    params = resumed
    for step in range(4, 8):
        for ps in (params, ref_params):
            set_mixed_grads(ps, step)
        optimizer.step()
        reference.step()

    for ours, ref in zip(params, ref_params):
        assert ours.dtype == ref.dtype
        assert torch.equal(ours, ref)
    for ours, ref in zip(params, ref_params):
        assert torch.equal(optimizer.state[ours]["previous_update"], reference.base.state[ref]["previous_update"])
    assert not torch.equal(params[0], mixed_params()[0])


def two_groups_adamw(params):
    """Two groups with their own learning rate, betas and weight decay."""
    return torch.optim.AdamW(
        [{"params": params[::2], "weight_decay": 0.1}, {"params": params[1::2], "lr": 0.02, "betas": (0.8, 0.9)}],
        lr=0.01,
    )


def assert_within_rounding(ours, ref):
    """float32 and float64 to float32 rounding; bfloat16 to a few units in its last place (8 bits), which a
    rounding made one step earlier reaches through the base optimizer's next steps."""
    tolerance = {torch.bfloat16: 2**-5, torch.float32: 1e-5, torch.float64: 1e-5}[ours.dtype]
    torch.testing.assert_close(ours.double(), ref.double(), rtol=tolerance, atol=tolerance * 1e-2)


@pytest.mark.parametrize("coefficient", [1.0, "auto"])
def test_matches_per_tensor_reference_with_groups_schedules_and_a_reference_state_dict(coefficient):
    """Mixed dtypes, two groups with their own weight decay, the learning rates changed every step, a parameter
    that joins late; halfway, a fresh wrapper loads the state dict the reference wrote (the documented format)
    and continues. Fixed coefficients to the bit, "auto" within rounding (its inner products come from norms)."""
    params, ref_params = mixed_params(), mixed_params()
    optimizer = DelayCorrected(two_groups_adamw(params), coefficient=coefficient)
    fixed = coefficient != "auto"
    reference = PerTensorReference(two_groups_adamw(ref_params), coefficient)

    def step(step_index):
        for opt in (optimizer, reference.base):
            for group, factor in zip(opt.param_groups, (1.0 / (1 + step_index), 1.5 ** (step_index % 2))):
                group.setdefault("initial_lr", group["lr"])
                group["lr"] = group["initial_lr"] * factor
        for ps in (params, ref_params):
            set_mixed_grads(ps, step_index, skip=2 if step_index < 2 else None)
        optimizer.step()
        reference.step()

    def check():
        for ours, ref in zip(params, ref_params):
            assert ours.dtype == ref.dtype
            if fixed:
                assert torch.equal(ours, ref)
            else:
                assert_within_rounding(ours, ref)

    for step_index in range(4):
        step(step_index)
    check()
    saved = io.BytesIO()
    torch.save(reference.base.state_dict(), saved)
    saved.seek(0)
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = DelayCorrected(two_groups_adamw(params), coefficient=coefficient)
    optimizer.load_state_dict(torch.load(saved))
    for step_index in range(4, 8):
        step(step_index)
    check()
    plain = mixed_params()
    run_plain = two_groups_adamw(plain)
    for step_index in range(8):
        set_mixed_grads(plain, step_index, skip=2 if step_index < 2 else None)
        run_plain.step()
    assert not torch.allclose(params[0], plain[0], atol=1e-4), "the correction had no effect"
    if not fixed:
        lookahead = [float(optimizer.state[p]["lookahead"]) for p in params]
        expected = [float(reference.base.state[p]["lookahead"]) for p in ref_params]
        assert lookahead == pytest.approx(expected, abs=2e-2) and max(lookahead) > 0


class OpCounter(TorchDispatchMode):
    """Counts the aten operations run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_of_a_step(optimizer, params) -> collections.Counter:
    for step in range(3):
        set_grads(params, step)
        optimizer.step()
    counter = OpCounter()
    with counter:
        optimizer.step()
    return counter.ops


@pytest.mark.parametrize("coefficient", [1.0, "auto"])
def test_ops_per_step_do_not_grow_with_the_parameters_and_read_nothing_on_the_host(coefficient):
    """The correction is a fixed number of multi-tensor ops (on a GPU, kernel launches) whatever the number of
    tensors, and it reads no value on the host (``item``, ``bool`` on a tensor: a synchronization on a GPU)."""
    added = []
    for count in (4, 40):
        params = [p for _ in range(count // 4) for p in make_params()]
        base = ops_of_a_step(torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=True), params)
        params = [p for _ in range(count // 4) for p in make_params()]
        ours = DelayCorrected(torch.optim.SGD(params, lr=LR, momentum=0.9, foreach=True), coefficient=coefficient)
        ops = ops_of_a_step(ours, params)
        assert ops["aten._local_scalar_dense.default"] == base["aten._local_scalar_dense.default"] == 0
        added.append(sum(ops.values()) - sum(base.values()))
    assert added[0] == added[1] <= (6 if coefficient == 1.0 else 30), added
