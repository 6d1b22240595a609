"""``python -m engine.bench.step_bound``: an urgent request's first token behind a long background
prefill, with the scheduler's step bound and without (the hook the voice co-scheduler uses).

A background prompt of ``--long`` tokens is being prefilled ``--budget`` tokens a step when an
urgent turn ends (its speaker stops). Its request (``--prompt`` tokens, a more urgent class)
arrives ``--asr-ms`` later, as its transcript would. With the bound, from that instant to the
request's first token the background gets at most ``--bound`` tokens a step. Printed: the wait
from the instant to the first token (p50 and max over ``--trials``, on and off interleaved),
and the background's own prefill time. Nothing else runs on the device while the "transcript" is
awaited (in the server, Whisper would).

    python -m engine.bench.step_bound --model engine/configs/llama-3.1-8b.json --load-format dummy
    python -m engine.bench.step_bound --model "$(python -m assistant.models path llm)" --long 1500 --budget 512 --bound 64
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore
from engine.bench.workload import random_prompt
from engine.sampling import SamplingParams
from engine.scheduler import StepBound

URGENT, BACKGROUND = -1, 0


def one_trial(core: EngineCore, bound: list[StepBound | None], bounded: StepBound | None, a: argparse.Namespace,
              rng: random.Random) -> tuple[float, float]:  # fmt: skip
    """(ms from the turn's end to the urgent first token, ms of the background's whole prefill)."""
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    background = core.add_request(random_prompt(rng, a.long, vocab), params, priority=BACKGROUND)
    started = time.perf_counter()
    for _ in range(2):  # well into its prefill
        core.step()
    ended = time.perf_counter()
    bound[0] = bounded
    urgent = None
    while urgent is None or urgent.metrics.first_token_time is None:
        if urgent is None and time.perf_counter() - ended >= a.asr_ms / 1000:
            urgent = core.add_request(random_prompt(rng, a.prompt, vocab), params, priority=URGENT)
        core.step()
    bound[0] = None
    while core.has_unfinished_requests():
        core.step()
    return (urgent.metrics.first_token_time - ended) * 1000, (background.metrics.first_token_time - started) * 1000


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.bench.step_bound", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--long", type=int, default=16_000, help="background prompt tokens (default 16000)")
    p.add_argument("--prompt", type=int, default=64, help="urgent prompt tokens (default 64)")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (default 2048)")
    p.add_argument("--bound", type=int, default=256, help="background tokens a step while the turn waits (default 256)")
    p.add_argument("--asr-ms", type=float, default=20.0, help="from the turn's end to its request (default 20)")
    p.add_argument("--trials", type=int, default=5)
    a = p.parse_args(argv)
    bound: list[StepBound | None] = [None]
    config = EngineConfig(model=a.model, load_format=a.load_format, device=a.device, max_num_seqs=8,
                          max_num_batched_tokens=a.budget, max_model_len=a.long + a.prompt + 16)  # fmt: skip
    core = build_engine(config, step_bound=lambda: bound[0])
    rng = random.Random(0)
    waits: dict[str, list[float]] = {"off": [], "on": []}
    prefills: dict[str, list[float]] = {"off": [], "on": []}
    one_trial(core, bound, None, a, rng)  # warm-up: this shape's kernels and graphs
    for _ in range(a.trials):
        for mode, bounded in (("off", None), ("on", StepBound(URGENT, a.bound))):
            core.block_manager.reset_prefix_cache()
            wait, prefill = one_trial(core, bound, bounded, a, rng)
            waits[mode].append(wait)
            prefills[mode].append(prefill)
    print(f"device {core.device}, background {a.long} tokens at {a.budget} a step, urgent {a.prompt} tokens "
          f"{a.asr_ms:g} ms after the turn's end, bound {a.bound} tokens a step, {a.trials} trials")  # fmt: skip
    print(f"{'step bound':<12}{'turn end -> first token p50 ms':>32}{'max ms':>10}{'background prefill p50 ms':>28}")
    for mode in ("off", "on"):
        print(f"{mode:<12}{statistics.median(waits[mode]):>32.1f}{max(waits[mode]):>10.1f}{statistics.median(prefills[mode]):>28.1f}")


if __name__ == "__main__":
    main()
