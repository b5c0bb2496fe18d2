"""Schedules as data, in pure Python (no torch): actions, their generation, verification, transfer ordering,
simulation and layer partitioning."""

from lightning_async_pp.schedule.schedule import *  # noqa: F403
from lightning_async_pp.schedule.schedule import __all__  # noqa: F401
