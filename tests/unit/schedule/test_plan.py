"""The plan's arithmetic (no torch): stage memory and predicted time against closed forms."""

from __future__ import annotations

import pytest

from lightning_async_pp.schedule.plan import (
    LayerFigures,
    ParameterFigures,
    activation_bytes,
    low_precision_copies,
    predict_time,
    stage_memory,
)
from lightning_async_pp.schedule.simulate import StageCosts


def layer(name: str, numel: int, saved: int = 100, width: int = 10, input_saved: bool = True) -> LayerFigures:
    params = {name: ParameterFigures(numel, 4 * numel, 8 * numel, 2 * numel, correction_bytes=4 * numel)}
    return LayerFigures(params, saved, width, input_saved, width, False, flops=6.0 * numel)


def test_stage_memory_closed_forms_under_2bw_and_1f1b():
    layers = [layer(f"w{i}", 1000 * (i + 1)) for i in range(4)]
    partition = [range(0, 2), range(2, 4)]
    none = [False] * 4
    for kind, versions in (("2bw", 2), ("1f1b", 1)):
        stages = stage_memory(layers, partition, kind, 4, 1, False, none, autocast=True)
        for s, st in enumerate(stages):
            numel = sum(1000 * (i + 1) for i in partition[s])
            assert st.parameters == numel
            assert st.weights == versions * 4 * numel
            assert st.gradients == 4 * numel  # one replica: no communication buffer
            assert (st.optimizer_state, st.correction) == (8 * numel, 4 * numel)
            assert st.low_precision_copies == versions * 2 * numel
            assert st.in_flight == 2 - s
        # Stage 0: each layer's saved tensors and input (both inputs saved) and the output it sends on.
        assert stages[0].activations_per_microbatch == 2 * 100 + 2 * 10 + 10
        assert stages[0].total == stages[0].weights + (4 + 8 + 4) * 3000 + versions * 6000 + 2 * 230


def test_replicas_add_the_communication_buffer_and_shard_the_state():
    layers = [layer("a", 800), layer("b", 800)]
    plain = stage_memory(layers, [range(2)], "1f1b", 2, 8, False, [False, False], autocast=False)[0]
    sharded = stage_memory(layers, [range(2)], "1f1b", 2, 8, True, [False, False], autocast=False)[0]
    assert plain.gradients == 2 * 4 * 1600  # .grad and the all-reduce's flat buffer
    assert sharded.gradients == 2 * 4 * 1600 + 4 * 1600 // 8  # and the reduce-scatter's output
    assert plain.optimizer_state == 8 * 1600 and sharded.optimizer_state == 8 * 1600 // 8
    assert plain.correction == 4 * 1600 and sharded.correction == 4 * 1600 // 8
    assert plain.low_precision_copies == 0


def test_sharding_counts_the_heaviest_replica_and_the_padded_buffer():
    layers = [layer("a", 1000), layer("b", 200)]
    owners = lambda sizes, replicas: {"a": 0, "b": 1}  # noqa: E731  (the runtime's plan_owners would agree)
    (st,) = stage_memory(layers, [range(2)], "1f1b", 2, 2, True, [False, False], autocast=False, owners=owners)
    # .grad, the flat buffer of two segments as long as the longest (a's), and the owner's received segment.
    assert st.gradients == 4 * 1200 + 2 * 4 * 1000 + 4 * 1000
    assert (st.optimizer_state, st.correction) == (8 * 1000, 4 * 1000)


def test_low_precision_copies_follow_the_weight_versions():
    assert [low_precision_copies(v, True) for v in (1, 2)] == [1, 2]
    assert low_precision_copies(2, False) == 0


def test_a_tied_weight_on_one_stage_counts_once():
    tied = ParameterFigures(100, 400, 800)
    a = LayerFigures({"emb": tied}, 0, 1, False, 1, False, 0.0)
    b = LayerFigures({"emb": tied, "x": ParameterFigures(10, 40, 80)}, 0, 1, False, 1, False, 0.0)
    (only,) = stage_memory([a, b], [range(2)], "1f1b", 1, 1, False, [False, False], autocast=False)
    assert only.parameters == 110


def test_recomputation_keeps_inputs_and_adds_one_layer_during_backward():
    layers = [layer("a", 10, saved=1000, input_saved=False), layer("b", 10, saved=3000, input_saved=False)]
    held, transient = activation_bytes(layers, [False, False], first=False, last=False)
    assert (held, transient) == (1000 + 3000 + 10 + 10, 0)  # received input, both layers' tensors, output
    held, transient = activation_bytes(layers, [True, True], first=False, last=False)
    assert (held, transient) == (10 + 10 + 10, 3000 + 10)  # inputs kept; the largest layer recomputed at once
    held, _ = activation_bytes(layers, [False, False], first=False, last=True, loss_saved_bytes=7)
    assert held == 1000 + 3000 + 10 + 7  # the last stage keeps the loss's tensors, not an output to send


@pytest.mark.parametrize("P, M", [(2, 4), (4, 8), (4, 4)])
def test_predicted_time_matches_the_closed_forms(P, M):
    f = 0.01
    # 2BW keeps every stage busy in its steady state: M forwards and backwards per step.
    two = predict_time([f] * P, "2bw", M)
    assert two.step_seconds == pytest.approx(M * 3 * f, rel=1e-6)
    assert two.bubble == pytest.approx(0.0, abs=1e-6)
    # 1F1B flushes every step: (M + P - 1) slots of forward and backward.
    one = predict_time([f] * P, "1f1b", M)
    assert one.step_seconds == pytest.approx((M + P - 1) * 3 * f, rel=1e-6)
    assert one.bubble == pytest.approx((P - 1) / (M + P - 1), rel=1e-6)
    # Recomputation adds one forward to every backward.
    again = predict_time([f] * P, "2bw", M, recompute_seconds=[f] * P)
    assert again.step_seconds == pytest.approx(M * 4 * f, rel=1e-6)
    # Host time around each forward and backward is paid like the layers' own.
    host = predict_time([f] * P, "2bw", M, overhead=[StageCosts(f / 2, f / 2)] * P)
    assert host.step_seconds == pytest.approx(M * 4 * f, rel=1e-6)
