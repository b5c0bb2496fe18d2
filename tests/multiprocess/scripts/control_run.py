"""Trains a tiny pipeline and records, per rank, the collectives each training step posts
and where a SIGTERM stopped training.

    python -m tests.multiprocess.scripts.control_run --devices 2 --pipeline-size 2 --out DIR \
        [--sigterm-rank R --sigterm-step S]

Writes ``DIR/rank{r}.json``: ``collectives`` (per step, the list of ``[function, group size]`` called from one
``on_train_batch_start`` to the next), ``stopped_at`` (the ``global_step`` at which a ``SIGTERMException``
reached ``on_exception``, or null) and ``received_sigterm`` (``trainer.received_sigterm`` then).
"""

import argparse
import json
import os
import signal
import threading
from datetime import timedelta
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from tests.fixtures.helpers import loader, random_batches, tiny_gpt  # noqa: E402

COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "monitored_barrier",
)


class Record(Callback):
    def __init__(self, out: str, sigterm_rank: int, sigterm_step: int) -> None:
        self.out, self.sigterm_rank, self.sigterm_step = out, sigterm_rank, sigterm_step
        self.steps: list[list] = []
        self.calls: list = []
        self.stopped_at = None
        self.received = None

    def setup(self, trainer, pl_module, stage) -> None:
        torch.set_num_threads(1)
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                group = kwargs.get("group")
                # The training steps' collectives; the failure watchdog's heartbeat runs in a thread of its own, by
                # the clock (once a second), never inside a step.
                if threading.current_thread() is threading.main_thread():
                    self.calls.append(
                        [_name, dist.get_world_size(group) if group is not None else dist.get_world_size()]
                    )
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append(self.calls)
        self.calls = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.sigterm_rank and trainer.global_step == self.sigterm_step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, SIGTERMException):
            self.stopped_at = trainer.global_step
            self.received = trainer.received_sigterm
        self._write(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._write(trainer)

    def _write(self, trainer) -> None:
        record = {
            "collectives": self.steps[1:],
            "stopped_at": self.stopped_at,
            "received_sigterm": self.received,
            "global_step": trainer.global_step,
        }
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pipeline-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sigterm-rank", type=int, default=-1)
    parser.add_argument("--sigterm-step", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    replicas = args.devices // args.pipeline_size
    # Lightning starts the other ranks by running this script again ("popen"), so each rank handles its own
    # exceptions and runs `on_exception` (with "spawn" only the main process would).
    strategy = AsyncPipelineStrategy(
        num_microbatches=2, pipeline_parallel_size=args.pipeline_size, timeout=timedelta(seconds=60)
    )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        max_steps=args.steps,
        callbacks=[Record(args.out, args.sigterm_rank, args.sigterm_step)],
    )
    try:
        trainer.fit(tiny_gpt(n_layer=2), loader(random_batches(args.steps * replicas, batch_size=4)))
    except BaseException as error:  # SIGTERMException, re-raised after `on_exception`
        print(f"FIT RAISED {type(error).__name__}: {str(error)[-500:]}")


if __name__ == "__main__":
    main()
