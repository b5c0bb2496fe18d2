"""Throughput and MFU of a pipeline: the peak table, the FLOPs per stage, the arithmetic, and what a fit logs."""

from __future__ import annotations

import time

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from torch.utils.flop_counter import FlopCounterMode

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.models.hf import CausalLM
from lightning_async_pp.runtime.contract import run_layers
from lightning_async_pp.runtime.recompute import checkpoint_layers
from lightning_async_pp.strategy import throughput
from lightning_async_pp.strategy.throughput import (
    PipelineThroughputMonitor,
    count_items,
    meta_layers,
    peak_flops_of,
    stage_flops,
    throughput_metrics,
)
from tests.fixtures.helpers import fit, random_batches, tiny_gpt
from tests.fixtures.hf_models import CONFIGS
from tests.multiprocess.scripts.throughput_run import BLOCK, N_EMBD, N_LAYER, gpt_flops_per_token


def cpu_flops(module, batch) -> int:
    """FlopCounterMode on the unsplit model, run for real on the CPU (whose fused attention it does not count)."""
    with FlopCounterMode(display=False) as counter:
        out = run_layers(module.pipeline_layers(), module.pipeline_inputs(batch), batch)
        module.pipeline_loss(out, batch).backward()
    module.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA B200", 2250e12),
    ],
)
def test_peak_of_known_accelerators(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    flops, source = peak_flops_of(torch.device("cuda", 0))
    assert flops == peak and name in source


def test_no_peak_on_cpu_unless_given():
    assert peak_flops_of(torch.device("cpu"))[0] is None
    assert peak_flops_of(torch.device("cpu"), given=2e12) == (2e12, "given")


def test_tokens_or_samples():
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert count_items((ids, ids)) == (64, "tokens")
    assert count_items({"input_ids": ids, "labels": ids}) == (64, "tokens")
    assert count_items((ids, ids), unit="samples") == (4, "samples")
    features = (torch.zeros(4, 2, 8), torch.zeros(4, dtype=torch.long))
    assert count_items(features) == (4, "samples")
    with pytest.raises(ValueError, match="unit='samples'"):
        count_items(features, unit="tokens")


def test_stage_flops_sum_to_the_whole_model():
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=N_LAYER, n_embd=N_EMBD, block_size=BLOCK)
    before = [p.detach().clone() for p in model.parameters()]
    batch = random_batches(1, batch_size=4, block=BLOCK)[0]
    tokens = batch[0].numel()
    layers = meta_layers(model, list(model.pipeline_layers()))
    for partition in ([range(0, 3), range(3, 6)], [range(0, 1), range(1, 5), range(5, 6)]):
        counts = stage_flops(layers, partition, model.pipeline_inputs, model.pipeline_loss, batch)
        assert len(counts) == len(partition) and all(c > 0 for c in counts[1:])  # an embedding alone: 0
        assert sum(counts) == gpt_flops_per_token(model) * tokens
    # Counted on the meta device: the model's weights and gradients are untouched.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    attention = 3 * 4 * N_LAYER * BLOCK * N_EMBD * tokens
    assert sum(counts) == cpu_flops(model, batch) + attention


def test_compiled_and_recomputed_layers_count_their_model_flops():
    model = tiny_gpt(n_layer=N_LAYER, n_embd=N_EMBD, block_size=BLOCK, compile=True)
    layers = list(model.pipeline_layers())
    checkpoint_layers(layers, range(1, 5))  # as activation_checkpointing=True does; the copy runs plain forwards
    batch = random_batches(1, batch_size=4, block=BLOCK)[0]
    counts = stage_flops(
        meta_layers(model, layers), [range(0, 3), range(3, 6)], model.pipeline_inputs, model.pipeline_loss, batch
    )
    assert sum(counts) == gpt_flops_per_token(model) * batch[0].numel()


def test_stage_flops_of_a_hugging_face_llama():
    model = CausalLM(model_type="llama", config=CONFIGS["llama"])
    model.configure_model()
    ids = torch.randint(0, 96, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    layers = meta_layers(model, list(model.pipeline_layers()))
    whole = stage_flops(layers, [range(len(layers))], model.pipeline_inputs, model.pipeline_loss, batch)
    split = stage_flops(layers, [range(0, 3), range(3, len(layers))], model.pipeline_inputs, model.pipeline_loss, batch)
    config = CONFIGS["llama"]
    attention = 3 * 4 * config["num_hidden_layers"] * 16 * config["hidden_size"] * ids.numel()
    assert sum(split) == sum(whole) == cpu_flops(model, batch) + attention


def test_arithmetic_by_hand():
    # 2 stages x 3 replicas; one replica read 10 steps of 4 x 16 tokens in 8 s.
    metrics = throughput_metrics(640, 40, 10, 8.0, "tokens", 3, 6, flops_per_item=1e6, peak_flops=1e9)
    assert metrics["throughput/tokens_per_sec_per_replica"] == 80.0
    assert metrics["throughput/tokens_per_sec"] == 240.0
    assert metrics["throughput/samples_per_sec"] == 15.0
    assert metrics["throughput/sec_per_step"] == 0.8
    assert metrics["throughput/flops_per_sec"] == 240e6
    assert metrics["throughput/mfu"] == pytest.approx(240e6 / 6e9)
    assert "throughput/mfu" not in throughput_metrics(640, 40, 10, 8.0, "tokens", 3, 6, flops_per_item=1e6)
    samples = throughput_metrics(40, 40, 10, 8.0, "samples", 1, 2)
    assert set(samples) == {
        "throughput/samples_per_sec",
        "throughput/samples_per_sec_per_replica",
        "throughput/sec_per_step",
    }


class Recorder(Logger):
    """Keeps what is logged, step by step."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    name, version, experiment = "recorder", 0, None

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_logged_mfu_on_cpu_equals_the_hand_computation():
    torch.manual_seed(0)
    model = tiny_gpt(n_layer=N_LAYER, n_embd=N_EMBD, block_size=BLOCK)
    by_hand = gpt_flops_per_token(model)
    peak, recorder, clock = 5e9, Recorder(), WallClock()
    monitor = PipelineThroughputMonitor(peak_flops=peak)
    batches = random_batches(6, batch_size=4, block=BLOCK)
    strategy = AsyncPipelineStrategy(num_microbatches=2)
    fit(model, batches, strategy, logger=recorder, log_every_n_steps=2, callbacks=[monitor, clock])
    logged = [(step, m) for step, m in recorder.logged if "throughput/mfu" in m]
    assert [step for step, _ in logged] == [1, 3, 5]
    assert monitor.flops_per_item == by_hand  # the micro-batch's count, per token
    for _, m in logged:
        tokens_per_sec = m["throughput/tokens_per_sec"]
        assert tokens_per_sec * m["throughput/sec_per_step"] == pytest.approx(4 * BLOCK)
        assert m["throughput/tokens_per_sec_per_replica"] == tokens_per_sec
        assert m["throughput/mfu"] == pytest.approx(by_hand * tokens_per_sec / peak, rel=0.01)
    # The logged time is wall time: two steps between logs, each holding the clock's sleep.
    for (_, m), (before, after) in zip(logged[1:], [(1, 3), (3, 5)]):
        elapsed = clock.times[after] - clock.times[before]
        assert 2 * m["throughput/sec_per_step"] == pytest.approx(elapsed, rel=0.1)
        assert m["throughput/sec_per_step"] >= WallClock.SLEEP


def test_with_accumulation_a_step_is_an_optimizer_step():
    """``accumulate_grad_batches=2``: logged once per optimizer step, whose time covers both batches' tokens."""
    recorder = Recorder()
    model = tiny_gpt(n_layer=2, n_embd=N_EMBD, block_size=BLOCK)
    batches = random_batches(4, batch_size=4, block=BLOCK)
    fit(
        model,
        batches,
        AsyncPipelineStrategy(throughput_monitor=True),  # on one device it is not a default
        logger=recorder,
        log_every_n_steps=1,
        accumulate_grad_batches=2,
        max_steps=2,
    )
    logged = [(step, m) for step, m in recorder.logged if "throughput/tokens_per_sec" in m]
    assert [step for step, _ in logged] == [0, 1]
    for _, m in logged:
        assert m["throughput/tokens_per_sec"] * m["throughput/sec_per_step"] == pytest.approx(2 * 4 * BLOCK)


class WallClock(Callback):
    """Notes the wall time after each step's other callbacks, then sleeps: time a wrong clock would miss."""

    SLEEP = 0.05

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter())
        time.sleep(self.SLEEP)


def test_installed_by_the_strategy_with_a_logger_only():
    def monitors(logger) -> list:
        model = tiny_gpt(n_layer=2, n_embd=N_EMBD, block_size=BLOCK)
        fit(
            model,
            random_batches(2, batch_size=4, block=BLOCK),
            AsyncPipelineStrategy(throughput_monitor=True),  # on one device only when asked for
            logger=logger,
            log_every_n_steps=1,
            callbacks=[],
        )
        return [c for c in model.trainer.callbacks if isinstance(c, PipelineThroughputMonitor)]

    recorder = Recorder()
    assert len(monitors(recorder)) == 1
    logged = [m for _, m in recorder.logged if "throughput/tokens_per_sec" in m]
    # On a CPU without a given peak: FLOP/s, no MFU.
    assert len(logged) == 2 and all("throughput/mfu" not in m and "throughput/flops_per_sec" in m for m in logged)
    assert monitors(False) == []


def test_logged_through_lightning_at_its_steps_and_turned_off_by_the_strategy_argument():
    """The strategy's monitor's values reach the logger in Lightning's own calls, at the steps
    ``log_every_n_steps`` chooses: the same calls, at the same steps, as a run without the monitor (the
    reference), each with the throughput added; on one device none is added unless asked for."""

    def run(throughput_monitor: bool | None) -> tuple[list[tuple[int, dict]], list]:
        recorder, model = Recorder(), tiny_gpt(n_layer=1, n_embd=N_EMBD, block_size=BLOCK)
        strategy = AsyncPipelineStrategy(throughput_monitor=throughput_monitor)
        batches = random_batches(5, batch_size=4, block=BLOCK)
        fit(model, batches, strategy, logger=recorder, log_every_n_steps=2, callbacks=[])
        return recorder.logged, [c for c in model.trainer.callbacks if isinstance(c, PipelineThroughputMonitor)]

    with_monitor, monitors = run(True)
    without, none = run(None)
    assert len(monitors) == 1 and none == [] and run(False)[1] == []
    assert [step for step, _ in with_monitor] == [step for step, _ in without] == [1, 3]
    for (_, logged), (_, reference) in zip(with_monitor, without):
        assert set(logged) - set(reference) == {
            "throughput/samples_per_sec",
            "throughput/tokens_per_sec",
            "throughput/tokens_per_sec_per_replica",
            "throughput/sec_per_step",
            "throughput/flops_per_sec",
        }
    assert not any(key.startswith("throughput/") for _, logged in without for key in logged)


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="'auto', 'tokens' or 'samples'"):
        PipelineThroughputMonitor(unit="bytes")
    with pytest.raises(ValueError, match="peak_flops"):
        PipelineThroughputMonitor(peak_flops=0)
    assert throughput.PEAK_BF16_FLOPS
