"""Garbage-collector settings for the process whose event loop runs the rollouts.

Trajectories in flight keep each request's objects (aiohttp's request, response, connection
and timers, the coroutines awaiting them) alive for a whole generation. Under Python's
default thresholds (700, 10, 10) they outlive two young collections and reach the oldest
generation, which then fills fast enough to be collected whole about every other second at
2,000 trajectories in flight. A full collection walks every object in the process (torch's and
transformers' ~250k included) and stops the event loop for 0.15-0.6 s: most of the p99 turn
latency at that scale, and a quarter of the driver's CPU (bench/driver_scale.py).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # allocations between young collections (Python's default: 700)


def tune_gc_for_rollouts() -> None:
    """Call once, in the process that runs the rollouts, after start-up has built what lives
    for the whole run (imports, tokenizer, model, clients). That is frozen: no later collection
    walks it again. Young collections then come every 50,000 allocations, so a request's objects
    are usually freed by reference counting before any collection sees them; a garbage cycle
    (rare in the rollout path) lives a little longer before it is freed."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 10)
