"""The test suite, laid out like the library.

``unit/<layer>/`` tests one layer (schedule, runtime, strategy, checkpoint, optim, models, reference);
``multiprocess/`` real jobs of several processes, started from ``multiprocess/scripts/`` as
``python -m tests.multiprocess.scripts.<name>``; ``benchmarks/`` smoke tests of ``benchmarks/``; ``docs/`` the
docs, the CLI, the examples and ``scripts/gpu_check.py``; ``fixtures/`` the models, data and runners they share.

Tiers (markers, registered in pyproject.toml): the default (``make test``); ``multiprocess`` (``make test-mp``),
tests that start training jobs in other processes, but for one 2-stage exactness run and one failing job kept
in the default tier; ``slow`` (``make test-slow``).
"""
