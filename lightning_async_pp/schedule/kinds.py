"""The built-in schedule kinds, ``"2bw"`` and ``"1f1b"``, registered by name (see
:class:`~lightning_async_pp.schedule.ir.PipelineSchedule`; their definitions are in
:mod:`~lightning_async_pp.schedule.ir`'s docstring).

Terms: ``P`` stages, ``M`` micro-batches per step, stage ``s``, global micro-batch ``i = step * M + m``,
``W`` the stage's warm-up forwards.
"""

from __future__ import annotations

from lightning_async_pp.schedule.ir import Action, Op, PipelineSchedule, register_schedule, schedule_names

__all__ = ["SCHEDULES", "Schedule1F1B", "Schedule2BW"]


@register_schedule
class Schedule2BW(PipelineSchedule):
    """PipeDream-2BW: one continuous 1F1B stream across steps, each gradient applied one version later, two
    weight buffers, the pipeline flushed only where a run ends (validation, checkpoints, the end)."""

    name = "2bw"
    num_weight_versions = 2
    delay = 1
    checkpoint_lags = (0, 1)

    def validate(self, num_stages: int, num_microbatches: int) -> None:
        super().validate(num_stages, num_microbatches)
        # With M < P the first stage keeps micro-batches of three steps in flight
        # across two updates, which two weight buffers cannot hold.
        if num_microbatches < num_stages:
            raise ValueError(
                f"the '2bw' schedule needs num_microbatches >= the number of pipeline stages, got "
                f"num_microbatches={num_microbatches} with {num_stages} stages; set num_microbatches >= "
                f"{num_stages} (or use schedule='1f1b')"
            )

    def max_in_flight(self, num_stages: int, num_microbatches: int, stage: int) -> int:
        return num_stages - stage

    def updates_settled_by(self, num_stages: int) -> int | None:
        # Stage 0's UPDATE(t) follows the backward of global micro-batch (t+1)*M - 1 and precedes the forward of
        # (t+1)*M + P - 1, micro-batch P - 1 of step t + 1 (M >= P), whose activations carry it up the pipeline;
        # a higher stage's UPDATE(t) precedes its forward of the same micro-batch, which needs stage 0's.
        return num_stages - 1

    def compute_step(
        self, num_stages: int, num_microbatches: int, stage: int, step: int, run_start: int
    ) -> list[Action]:
        """For each micro-batch ``m``: ``F(step, m)``, then the backward of ``i - W`` (``W = P-1-s``) if it
        belongs to the run, a backward that completes a step followed by that step's ``UPDATE``."""
        M, warmup = num_microbatches, num_stages - 1 - stage
        out: list[Action] = []
        for m in range(M):
            i = step * M + m
            out.append(self.compute_action(stage, Op.FORWARD, i, M))
            if i - warmup >= run_start * M:
                out += self._backward(stage, i - warmup, M)
        return out

    def compute_drain(
        self, num_stages: int, num_microbatches: int, stage: int, last_step: int, run_start: int
    ) -> list[Action]:
        """The last ``P-1-s`` backwards (all of ``last_step``, since ``M >= P``) and ``UPDATE(last_step)``."""
        M = num_microbatches
        end = (last_step + 1) * M
        out: list[Action] = []
        for i in range(max(run_start * M, end - (num_stages - 1 - stage)), end):
            out += self._backward(stage, i, M)
        return out

    def last_gradient_before_forward(self, num_stages: int, num_microbatches: int, stage: int, index: int) -> int:
        # The forward of i follows the backward of i - W - 1.
        return index - (num_stages - 1 - stage) - 1

    def _backward(self, stage: int, index: int, num_microbatches: int) -> list[Action]:
        out = [self.compute_action(stage, Op.BACKWARD, index, num_microbatches)]
        if index % num_microbatches == num_microbatches - 1:
            # Update on the stage's own clock as soon as its share of the gradient is complete.
            out.append(self.update_action(stage, index // num_microbatches, num_microbatches))
        return out


@register_schedule
class Schedule1F1B(PipelineSchedule):
    """Synchronous, flushed 1F1B: every step self-contained, on the version the previous update produced,
    with one weight buffer."""

    name = "1f1b"
    num_weight_versions = 1
    delay = 0
    checkpoint_lags = (0,)

    def flush_steps(self, num_steps: int, run_starts: tuple[int, ...]) -> range:
        return range(1, num_steps)

    def max_in_flight(self, num_stages: int, num_microbatches: int, stage: int) -> int:
        return min(num_stages - stage, num_microbatches)

    def updates_settled_by(self, num_stages: int) -> int | None:
        return None  # the next step runs on version t + 1 from its first micro-batch

    def compute_step(
        self, num_stages: int, num_microbatches: int, stage: int, step: int, run_start: int
    ) -> list[Action]:
        """``W = min(P-1-s, M)`` warm-up forwards, one forward and one backward alternately, the remaining
        backwards, then ``UPDATE(step)``."""
        M = num_microbatches
        warmup = min(num_stages - 1 - stage, M)
        base = step * M
        out: list[Action] = []
        for m in range(M):
            out.append(self.compute_action(stage, Op.FORWARD, base + m, M))
            if m >= warmup:
                out.append(self.compute_action(stage, Op.BACKWARD, base + m - warmup, M))
        for m in range(M - warmup, M):
            out.append(self.compute_action(stage, Op.BACKWARD, base + m, M))
        out.append(self.update_action(stage, step, M))
        return out

    def compute_drain(
        self, num_stages: int, num_microbatches: int, stage: int, last_step: int, run_start: int
    ) -> list[Action]:
        return []  # every step ends empty

    def last_gradient_before_forward(self, num_stages: int, num_microbatches: int, stage: int, index: int) -> int:
        # The forward of micro-batch m follows the backwards of the step's first m - W micro-batches, and a step
        # starts after every backward of the one before.
        step, microbatch = divmod(index, num_microbatches)
        done = microbatch - min(num_stages - 1 - stage, num_microbatches)
        return step * num_microbatches + done - 1 if done > 0 else step * num_microbatches - 1


SCHEDULES = schedule_names()
"""The names ``AsyncPipelineStrategy(schedule=...)`` accepts."""
