"""One-off (2026-12-03, 2-core Xeon): batch-1 decode of the native CPU step while another process
keeps one core busy (as speech recognition or synthesis would in the voice path), on 2 threads,
on 1, and with the adaptive choice (engine/native_decode.py ThreadChoice), interleaved, against
the same without that process:
``PYTHONPATH=$PWD python engine/bench/experiments/native_contention.py MODEL.gguf [ROUNDS]``."""
import random
import subprocess
import sys
import time

from engine.bench.workload import random_prompt, run_to_completion
from engine.config import EngineConfig
from engine.engine_builder import build_engine
from engine.loaded_model import LoadedModel
from engine.native_decode import ThreadChoice
from engine.sampling import SamplingParams

config = EngineConfig(model=sys.argv[1], quantization="int4", max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=512)
core = build_engine(config, LoadedModel.load(config))
prompt = random_prompt(random.Random(0), 128, core.model_config.vocab_size)
choices = {"2 threads": lambda: ThreadChoice(2, adaptive=False), "1 thread": lambda: ThreadChoice(1, adaptive=False),
           "adaptive": lambda: ThreadChoice(2)}


def decode_rate(choice: ThreadChoice, tokens: int = 48) -> float:
    core.runner.native.thread_choice = choice
    core.block_manager.reset_prefix_cache()
    req = core.add_request(list(prompt), SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
    run_to_completion(core)
    return 1 / req.metrics.tpot


decode_rate(ThreadChoice(2), 4)
for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    for hog in (False, True):
        p = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if hog else None
        time.sleep(0.5)
        try:
            rates = {name: decode_rate(make()) for name, make in choices.items()}
        finally:
            if p:
                p.kill()
        print(f"round {rnd + 1}, {'one core busy' if hog else 'idle'}: "
              + ", ".join(f"{name} {rate:.2f} tok/s" for name, rate in rates.items()), flush=True)
