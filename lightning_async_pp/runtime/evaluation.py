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

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_async_pp.runtime import activations
from lightning_async_pp.runtime.comm import Channel
from lightning_async_pp.runtime.microbatch import batch_size_of, split_microbatches, tensors_of
from lightning_async_pp.schedule import Op, evaluation_actions, posting_plan

__all__ = ["EvaluatedStage", "JoinedOutput", "PipelineEvaluation", "evaluation_microbatches", "signature_of"]

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


class JoinedOutput:
    """The whole batch's output on the last stage, filled micro-batch by micro-batch along dimension 0.

    Each micro-batch's output is copied into its rows as soon as it is computed, so that besides the whole
    batch's output at most one micro-batch's is held (joining a list at the end would hold every one twice).

    Args:
        num_microbatches: How many micro-batches the batch was split into; with 1 the output is kept as it is.
    """

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self._value: Any = None
        self._tensors: list[torch.Tensor] = []
        self._spec: activations.Spec | None = None

    def add(self, index: int, output: Any) -> None:
        """Copy micro-batch ``index``'s output into its rows.

        Raises:
            TypeError: If the output is not a tensor, or a tuple, list or dict of tensors, each with a first
                dimension, or its structure or shapes differ from the first micro-batch's.
        """
        if self.num_microbatches == 1:
            self._value = output
            return
        try:
            tensors, spec = activations.flatten(output)
        except TypeError as error:
            raise TypeError(_CANNOT_JOIN + f" Got a {type(output).__name__}.") from error
        if any(t.dim() == 0 for t in tensors):
            raise TypeError(_CANNOT_JOIN + " Got a tensor without a batch dimension.")
        if self._spec is None:
            self._spec = spec
            self._tensors = [t.new_empty((self.num_microbatches * t.shape[0], *t.shape[1:])) for t in tensors]
        shapes = [(t.shape[0] // self.num_microbatches, *t.shape[1:]) for t in self._tensors]
        if (spec.kind, spec.keys) != (self._spec.kind, self._spec.keys) or [t.shape for t in tensors] != shapes:
            raise TypeError(
                _CANNOT_JOIN + f" Micro-batch {index} returned {[tuple(t.shape) for t in tensors]} ({spec.kind}), "
                f"the first {[tuple(s) for s in shapes]} ({self._spec.kind})."
            )
        for whole, part in zip(self._tensors, tensors):
            rows = part.shape[0]
            whole[index * rows : (index + 1) * rows].copy_(part)

    def result(self) -> Any:
        """The whole batch's output (a tensor, or the structure of the micro-batches' outputs)."""
        if self.num_microbatches == 1:
            return self._value
        assert self._spec is not None, "no micro-batch output was added"
        return activations.unflatten(self._tensors, self._spec)


class EvaluatedStage(Protocol):
    """What an evaluation reads of the stage it runs through, and nothing more (a
    :class:`~lightning_async_pp.runtime.stage.StageRuntime` is one, and builds its own evaluation).

    Attributes:
        stage: The stage's index.
        num_stages: Number of stages.
        module: The stage's layers; run as they are, so on the newest weights.
        inputs_fn: First stage: turns a micro-batch into the first layer's input.
        forward_context: Context manager factory around forwards (e.g. autocast).
        prev: The link from the previous stage (``None`` on the first stage).
        next: The link to the next stage (``None`` on the last stage).
        run_start: The first step of the training run in progress, ``None`` between runs (drained).
    """

    stage: int
    num_stages: int
    module: nn.Module
    inputs_fn: Callable[[Any], Tensor]
    forward_context: Callable[[], contextlib.AbstractContextManager]
    prev: Channel | None
    next: Channel | None
    run_start: int | None

    def receive_input(self) -> tuple[Any, activations.Spec]:
        """The previous stage's next message, as the value it sent, and its structure."""

    def output_message(self, y: Any) -> tuple[list[Tensor], activations.Spec]:
        """``y`` as the tensors of a message to the next stage."""

    def forget_layouts(self) -> None:
        """Negotiate each link's transfer layout again with the next message, and call the stage's
        :meth:`PipelineEvaluation.forget`."""


class PipelineEvaluation:
    """Runs evaluation batches through one stage of a pipeline, on the stage's newest weights.

    Args:
        stage: The stage it runs through: its position, layers and links (:class:`EvaluatedStage`).
    """

    def __init__(self, stage: EvaluatedStage) -> None:
        self._stage = stage
        self.signature: Signature | None = None  # of the micro-batches the links' layouts were negotiated for
        self._batches = 0  # evaluation batches run: the schedule's batch index and the tag of their sends

    def forget(self) -> None:
        """The links' layouts were forgotten: the next batch negotiates them again, whatever its signature."""
        self.signature = None

    @torch.no_grad()
    def run(self, batch: Any, num_microbatches: int) -> Any:
        """Forward ``batch`` through the stage in up to ``num_microbatches`` micro-batches; returns the whole batch's
        output on the last stage, else ``None``."""
        st = self._stage
        is_first, is_last = st.stage == 0, st.stage == st.num_stages - 1
        if st.run_start is not None:
            raise RuntimeError(
                f"Pipeline stage {st.stage} was asked to evaluate during a training run: call `drain()` first, so "
                "that no training message is in flight on its links."
            )
        count = evaluation_microbatches(batch, num_microbatches)
        microbatches = split_microbatches(batch, count)
        signature = signature_of(microbatches[0])
        if signature != self.signature:
            st.forget_layouts()  # every stage holds the same batch, so both ends of each link forget here
            self.signature = signature
        index, self._batches = self._batches, self._batches + 1
        actions = evaluation_actions(st.num_stages, st.stage, index, count)
        plan = posting_plan(actions)
        if Op.RECV_F in plan.start:
            st.prev.prefetch()
        received: dict[int, Any] = {}
        output, joined = None, JoinedOutput(count) if is_last else None
        for action, post_next in zip(actions, plan.post_next):
            if action.op is Op.RECV_F:
                received[action.microbatch] = st.receive_input()[0]
                if post_next:
                    st.prev.prefetch()  # the next micro-batch's transfer overlaps this one's forward
            elif action.op is Op.FORWARD:
                microbatch = microbatches[action.microbatch]
                x = st.inputs_fn(microbatch) if is_first else received.pop(action.microbatch)
                with st.forward_context():
                    output = st.module(x, microbatch)
                if joined is not None:
                    joined.add(action.microbatch, output)
            else:
                st.next.send(st.output_message(output)[0], post_recv=post_next, tag=index)
        if joined is None:
            # On gloo a send is let go only by a wait; the previous batch's have long been received.
            st.next.wait_sends(through=index - 1)
            return None
        return joined.result()


_CANNOT_JOIN = (
    "An evaluation batch split into micro-batches needs the last layer's outputs to be joined along their first "
    "(batch) dimension: return a tensor, or a tuple, list or dict (string keys) of tensors, each with a batch "
    "dimension, from the last pipeline layer."
)
