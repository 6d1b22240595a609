"""One-off (2026-12-07): where a speculating engine's host time goes, call by call.

The spec bench prints each engine's mean host phases a step. On an H100 (2026-12-07 14:22 UTC,
the 1.5B, k=8, n-grams 1..8) the schedule phase (with drafting) took 0.18 ms a step against 0.04
without speculation, and the device idled 0.40 ms after each verifying step, which is read back
at once; the proposer alone took ~25 us a call on a 2-core CPU. This runs ``engine.bench
speculative`` with the same arguments and times every call of the engine's host-side parts
(drafting, scheduling, preparing the step's inputs, finalizing a step's samples) per engine,
printing each one's calls, median, 90th percentile and mean: a median far below the mean points
at rare expensive calls (a request's first index, a garbage collection), a high median at the
per-step path itself.
Run from the repository root: ``PYTHONPATH=$PWD python engine/bench/experiments/spec_host_phases.py
ENGINE.BENCH.SPECULATIVE ARGS...`` (e.g. ``--model QWEN1.5B.gguf --documents
assistant/handbook/en/*.md --questions docs/results/2026-12-04-spec-questions-en32.txt --batch 1
--max-tokens 64 --k 8 --ngram-sizes 1 8``).
"""
import collections
import statistics
import sys
import time

import engine.bench.speculative as bench
from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler

times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
owner: dict[int, str] = {}  # id of an engine's scheduler or runner -> "plain" / "speculative"


def timed(cls: type, name: str, whose) -> None:
    """Wrap ``cls.name`` to record each call's seconds under (engine kind, name)."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            times[whose(self), name].append(time.perf_counter() - t0)

    setattr(cls, name, wrapper)


def kind(core: EngineCore) -> str:
    return "speculative" if core.proposer is not None else "plain"


for method in ("_propose_drafts", "_finalize", "_launch"):
    timed(EngineCore, method, kind)
timed(Scheduler, "schedule", lambda s: owner.get(id(s), "?"))
timed(ModelRunner, "prepare", lambda r: owner.get(id(r), "?"))
build = bench.build_engine


def build_and_name(config, loaded, **kwargs) -> EngineCore:
    core = build(config, loaded, **kwargs)
    owner[id(core.scheduler)] = owner[id(core.runner)] = kind(core)
    return core


bench.build_engine = build_and_name
bench.main(sys.argv[1:])
print("\nhost time by call (microseconds): calls, median, 90th percentile, mean")
for (engine, name), seconds in sorted(times.items()):
    seconds.sort()
    print(f"  {engine:<12} {name:<16} {len(seconds):>6} {1e6 * statistics.median(seconds):>9.1f} "
          f"{1e6 * seconds[int(0.9 * (len(seconds) - 1))]:>9.1f} {1e6 * sum(seconds) / len(seconds):>9.1f}")
