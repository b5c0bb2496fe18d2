"""Pipeline schedules on emulated devices: ours (``2bw``, ``1f1b``) against every schedule torch ships.

Every layer sleeps a fixed time in its forward, its input gradient and its weight gradient (three autograd
nodes, so torch's split backward runs the weight gradient apart: :mod:`.layers`), and its activations have a
chosen size. A sleeping process leaves the CPU free, so ``P`` processes on 2 cores behave like ``P`` devices:
what is measured is the schedule, each runtime's host work and the transfers, not the model's compute.

For each ``P`` in ``--stages`` (default 2 4 8 16) one job of ``P`` processes (:mod:`.worker`) runs, for
each ``M = k P`` (``--multipliers``, default 1 2 4), our runtime with ``2bw`` and ``1f1b`` and torch's
``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (two virtual stages per rank for all but 1F1B:
:mod:`.grid`), the same layers and micro-batches for all, interleaved repetitions. A cell a schedule
refuses (torch's ``M`` constraints, 2BW's ``M >= P``) is listed with torch's or our own message.

Reported per cell (:mod:`.report`): the step time, the efficiency (the ideal step time of the busiest rank
over the measured one), the bubble, CPU time and peak stashed micro-batches per stage, and for ``ours_2bw``,
``ours_1f1b`` and ``torch_1f1b`` the step time our schedule simulator predicts from the measured sleeps.

Usage (from the repository root)::

    python -m benchmarks.emulated --out benchmarks/results/emulated/emulated.json \\
        --markdown benchmarks/results/emulated/emulated.md --png benchmarks/results/emulated/efficiency.png
    python -m benchmarks.emulated --quick          # P=2 and 4, M=P, 2 repetitions, 1 ms sleeps
    python -m benchmarks.emulated --render benchmarks/results/emulated/emulated.json
"""
