"""Evaluation through a pipeline: forwards only, each batch split into micro-batches that stream through the
stages, the last stage's outputs concatenated back into the output of the whole batch.

Micro-batches. A batch of ``B`` samples is split into the largest count up to ``num_microbatches`` (the
training's) that divides ``B`` (:func:`evaluation_microbatches`), and the stage runs
:func:`~lightning_async_pp.schedule.evaluation_actions`: receive micro-batch ``i``, forward it, send it on,
then ``i + 1``. Stage ``s`` forwards micro-batch ``i`` while stage ``s + 1`` forwards ``i - 1``, so the stages
work at the same time instead of in turn. For layers that treat each sample on its own (a transformer, an
MLP, BatchNorm in eval mode) the concatenated output equals the whole batch's output up to float
reassociation, provided each tensor of the last layer's output has the samples first (a sequence-first output
would be joined along the wrong dimension).

Layouts. The transfer layout of each link (see :mod:`~lightning_async_pp.runtime.comm`) is negotiated again
only when the *signature* of the micro-batches changes: the dtype and shape of each of their tensors. Every
stage of a pipeline holds the same batch, so every stage decides alike, without a message. What a stage sends
must therefore follow from those shapes; a layer whose output shape depends on the values (say, trimming
padding) makes the sender stop with an error naming both layouts. Training renegotiates at each run start, so
the first evaluation batch after training always does too.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_async_pp.runtime import activations
from lightning_async_pp.runtime.microbatch import batch_size_of, split_microbatches, tensors_of
from lightning_async_pp.schedule import Op, evaluation_actions, posting_plan

__all__ = ["PipelineEvaluation", "concatenate", "evaluation_microbatches", "signature_of"]

Signature = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def evaluation_microbatches(batch: Any, num_microbatches: int) -> int:
    """How many micro-batches an evaluation batch is split into: the largest count ``<= num_microbatches`` that
    divides its size (1 for a batch without a tensor to split, or whose tensors differ in size)."""
    try:
        size = batch_size_of(batch)
    except ValueError:
        return 1
    return max((d for d in range(1, min(num_microbatches, size) + 1) if size % d == 0), default=1)


def signature_of(microbatch: Any) -> Signature:
    """The dtype and shape of each tensor of ``microbatch``: what the transfer layouts of its forwards follow from."""
    return tuple((t.dtype, tuple(t.shape)) for t in tensors_of(microbatch))


def concatenate(outputs: list[Any]) -> Any:
    """The micro-batches' outputs joined along dimension 0: a tensor, or a tuple, list or dict of tensors.

    Raises:
        TypeError: If an output is something else, or holds a tensor without a batch dimension.
    """
    if len(outputs) == 1:
        return outputs[0]
    try:
        flat = [activations.flatten(y) for y in outputs]
    except TypeError as error:
        raise TypeError(_CANNOT_CONCATENATE + f" Got a {type(outputs[0]).__name__}.") from error
    parts = list(zip(*(tensors for tensors, _ in flat)))
    if any(t.dim() == 0 for group in parts for t in group):
        raise TypeError(_CANNOT_CONCATENATE + " Got a tensor without a batch dimension.")
    return activations.unflatten([torch.cat(group) for group in parts], flat[0][1])


class PipelineEvaluation:
    """Runs evaluation batches through one stage of a pipeline, on the stage's newest weights.

    Args:
        runtime: The stage's :class:`~lightning_async_pp.runtime.stage.StageRuntime`: its layers, links and
            message specs.
    """

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.signature: Signature | None = None  # of the micro-batches the links' layouts were negotiated for
        self._batches = 0  # evaluation batches run: the schedule's batch index and the tag of their sends

    def forget(self) -> None:
        """The links' layouts were forgotten: the next batch negotiates them again, whatever its signature."""
        self.signature = None

    @torch.no_grad()
    def run(self, batch: Any, num_microbatches: int) -> Any:
        """Forward ``batch`` through the stage in up to ``num_microbatches`` micro-batches; returns the whole batch's
        output on the last stage, else ``None``."""
        rt = self.runtime
        if rt.run_start is not None:
            raise RuntimeError(
                f"Pipeline stage {rt.stage} was asked to evaluate during a training run: call `drain()` first, so "
                "that no training message is in flight on its links."
            )
        count = evaluation_microbatches(batch, num_microbatches)
        microbatches = split_microbatches(batch, count)
        signature = signature_of(microbatches[0])
        if signature != self.signature:
            rt._forget_layouts()  # every stage holds the same batch, so both ends of each link forget here
            self.signature = signature
        index, self._batches = self._batches, self._batches + 1
        actions = evaluation_actions(rt.num_stages, rt.stage, index, count)
        plan = posting_plan(actions)
        if Op.RECV_F in plan.start:
            rt.prev.prefetch()
        received: dict[int, Any] = {}
        outputs: list[Any] = []
        for action, post_next in zip(actions, plan.post_next):
            if action.op is Op.RECV_F:
                received[action.microbatch] = rt._receive_input()[0]
                if post_next:
                    rt.prev.prefetch()  # the next micro-batch's transfer overlaps this one's forward
            elif action.op is Op.FORWARD:
                microbatch = microbatches[action.microbatch]
                x = rt.inputs_fn(microbatch) if rt.is_first else received.pop(action.microbatch)
                with rt.forward_context():
                    outputs.append(rt.module(x, microbatch))
            else:
                rt.next.send(rt._output_message(outputs.pop())[0], post_recv=post_next, tag=index)
        if not rt.is_last:
            # On gloo a send is let go only by a wait; the previous batch's have long been received.
            rt.next.wait_sends(through=index - 1)
            return None
        return concatenate(outputs)


_CANNOT_CONCATENATE = (
    "An evaluation batch split into micro-batches needs the last layer's outputs to be joined along their first "
    "(batch) dimension: return a tensor, or a tuple, list or dict (string keys) of tensors, each with a batch "
    "dimension, from the last pipeline layer."
)
