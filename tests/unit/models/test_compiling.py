"""The `compile` option of the demo GPT and CausalLM: which modules it compiles, names kept, bad values refused,
and the one-device 2BW path (``DelayedWeights`` swaps ``w[t-1]`` in by ``.data``) equal to eager.

The multi-process pipeline with compiled blocks is tested in ``tests/multiprocess/test_compile.py``.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback
from torch._dynamo.utils import counters

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.demos.gpt import Block
from lightning_async_pp.models.compiling import compile_kwargs, is_compiled
from tests.fixtures.helpers import fit, random_batches, tiny_gpt

AOT_EAGER = {"backend": "aot_eager"}


@pytest.mark.parametrize("value", ["yes", 1, {1: "x"}, ["aot_eager"]])
def test_bad_compile_values_say_what_to_give(value):
    with pytest.raises(ValueError, match="must be True .* False, or a dict of torch.compile keyword arguments"):
        compile_kwargs(value)
    with pytest.raises(ValueError, match="`compile` must be"):
        tiny_gpt(compile=value)


def test_compile_kwargs():
    assert compile_kwargs(False) is None
    assert compile_kwargs(True) == {}
    assert compile_kwargs({"backend": "aot_eager"}) == {"backend": "aot_eager"}


def test_gpt_compiles_its_blocks_in_place_and_keeps_its_names():
    eager, compiled = tiny_gpt(n_layer=3), tiny_gpt(n_layer=3, compile=AOT_EAGER)
    assert [is_compiled(layer) for layer in compiled.layers] == [False, True, True, True, False]
    assert not any(is_compiled(module) for module in eager.modules())
    assert all(isinstance(layer, Block) for layer in compiled.layers[1:-1])
    assert list(compiled.state_dict()) == list(eager.state_dict())


def test_causal_lm_compiles_each_transformers_decoder_layer_and_keeps_its_names():
    pytest.importorskip("transformers")
    from lightning_async_pp.models.hf_layers import DecoderLayer
    from tests.fixtures.hf_models import tiny_causal_lm

    eager, compiled = tiny_causal_lm("llama"), tiny_causal_lm("llama", compile=AOT_EAGER)
    compiled_modules = [module for module in compiled.modules() if is_compiled(module)]
    decoders = [layer for layer in compiled.layers if isinstance(layer, DecoderLayer)]
    # The transformers layer, not our wrapper: masks and rotary tables stay outside the compiled code.
    assert compiled_modules == [decoder.layer for decoder in decoders] and len(decoders) == 4
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert compiled.hf_name("layers.1.layer.mlp.up_proj.weight") == eager.hf_name("layers.1.layer.mlp.up_proj.weight")


class _Frames(Callback):
    def __init__(self) -> None:
        self.frames: list[int] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.frames.append(int(counters["frames"]["total"]))
        self.losses.append(float(outputs["loss"]))


def _one_device_2bw(compile_option, steps: int) -> tuple[_Frames, dict[str, torch.Tensor]]:
    model = tiny_gpt(n_layer=2, compile=compile_option)
    recorder = _Frames()
    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=2)
    fit(model, random_batches(steps), strategy=strategy, callbacks=[recorder])
    return recorder, {k: v.detach() for k, v in model.state_dict().items()}


def test_one_device_2bw_with_compiled_blocks_equals_eager_and_compiles_once():
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    eager, eager_weights = _one_device_2bw(False, steps=4)
    assert eager.frames == [0, 0, 0, 0]
    compiled, weights = _one_device_2bw(AOT_EAGER, steps=4)
    # Compiled at the first step; `w[t-1]` swapped in by `.data` every step after it compiles nothing more.
    assert compiled.frames[0] >= 1 and compiled.frames == [compiled.frames[0]] * 4
    # aot_eager runs the same ATen kernels as eager: the tolerance of the pipeline tests.
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-5, atol=1e-6)
    for name, value in eager_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
