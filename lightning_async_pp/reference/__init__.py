"""Delayed trajectories on one device, sharing no code with the runtime: the exact 2BW one-step delay that a
pipeline must match, and per-group delay profiles for studying staleness."""

from lightning_async_pp.reference.delayed import DelayedWeights
from lightning_async_pp.reference.profile import DelayProfile, pipedream_delays, split_into_stages

__all__ = ["DelayProfile", "DelayedWeights", "pipedream_delays", "split_into_stages"]
