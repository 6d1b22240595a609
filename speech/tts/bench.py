"""TTS pool timing: first audio and keeping up with playback, by worker count and concurrent answers.

    python -m speech.tts.bench [--workers 1,4,8] [--answers 1,8,32,64,128] [--first-max-chars 48,160]
                               [--backend hibari] [--json F]

For each (workers, first-piece limit, answers): a :class:`~speech.tts.worker.TTSWorker` with that
many voice instances gets that many answers at once, each cut by the pipeline's chunker
(:class:`~speech.config.ChunkerConfig` with that ``first_max_chars``) and sent as the pipeline
sends them: the first piece, then the later ones. The answers are real handbook answers; the
first-piece limit of ``max_chars`` (160) is the baseline, where an answer's first piece is its
whole first sentence or clause. Reported: time from submitting an answer to its first audio
(p50/p95/p99), answers whose audio fell behind real-time playback (a chunk ready after the
playback of the audio before it, counted from the first chunk, would have ended), and the pool's
throughput in seconds of audio per second. The machine's cores bound what more workers can give;
the program prints the figures, it checks nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from speech.cancel import CancelToken
from speech.chunker import chunk_text
from speech.config import ChunkerConfig, TTSConfig
from speech.tts.worker import TTSWorker

ANSWERS = (  # answers a handbook model gave, first sentences with and without an early comma
    "Full-time employees receive 20 days of paid annual leave per leave year from 1 January to 31 December. "
    "Part-time employees receive a pro-rata amount.",
    "To apply for annual leave, check your balance in PeopleHub under My Leave and submit the Leave Request form HR-01 "
    "there. Your line manager approves or declines it within 3 working days.",
    "The hotel limit outside London is 150 pounds per night including breakfast and taxes. Book it through the Travel Desk.",
    "The handbook does not say. Please ask Human Resources at hr@northwind.example.",
)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_answer(pool: TTSWorker, pieces_text: list[str]) -> tuple[float, float, bool]:
    """(seconds to first audio, seconds of audio, fell behind playback?) of one answer."""
    submitted = time.perf_counter()
    first_ready: float | None = None
    audio_s, behind = 0.0, False
    pieces = [pool.stream(text, CancelToken(), i == 0) for i, text in enumerate(pieces_text)]
    for piece in pieces:
        async for chunk, ready in piece:
            if first_ready is None:
                first_ready = ready
            behind |= ready > first_ready + audio_s
            audio_s += len(chunk.pcm) / chunk.sample_rate
    assert first_ready is not None, "the voice produced no audio"
    return first_ready - submitted, audio_s, behind


async def measure(pool: TTSWorker, answers: int, chunker: ChunkerConfig) -> dict[str, Any]:
    cut = [chunk_text(text, chunker) for text in ANSWERS]
    start = time.perf_counter()
    done = await asyncio.gather(*(one_answer(pool, cut[i % len(cut)]) for i in range(answers)))
    wall = time.perf_counter() - start
    first = [1000 * d[0] for d in done]
    return {"answers": answers, "first_audio_ms": {f"p{round(q * 100)}": round(quantile(first, q), 1) for q in (0.5, 0.95, 0.99)},
            "behind_playback": sum(d[2] for d in done), "audio_s_per_s": round(sum(d[1] for d in done) / wall, 1)}  # fmt: skip


def counts(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m speech.tts.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=counts, default=[1, max(1, (os.cpu_count() or 2) // 2)], help="pool sizes (default 1 and half the cores)")
    p.add_argument("--answers", type=counts, default=[1, 8, 32], help="concurrent answers (default 1,8,32)")
    p.add_argument("--first-max-chars", type=counts, default=[ChunkerConfig.first_max_chars, ChunkerConfig.max_chars],
                   help=f"first-piece limits to compare (default {ChunkerConfig.first_max_chars} and the baseline {ChunkerConfig.max_chars})")
    p.add_argument("--backend", default="hibari", choices=("hibari", "espeak", "coqui"))
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    rows = []
    print(f"{'workers':>7} {'first piece':>11} {'answers':>7} {'first audio p50/p95/p99 ms':>28} {'behind':>6} {'audio s/s':>9}", flush=True)
    for workers in a.workers:
        pool = TTSWorker.from_config(TTSConfig(backend=a.backend, workers=workers, seed=0))
        try:
            for limit in a.first_max_chars:
                chunker = ChunkerConfig(first_max_chars=limit)
                for answers in a.answers:
                    row = {"workers": workers, "first_max_chars": limit, **asyncio.run(measure(pool, answers, chunker))}
                    f = row["first_audio_ms"]
                    print(f"{workers:>7} {f'<= {chunker.first_limit}':>11} {answers:>7} {f['p50']:>10.0f} / {f['p95']:>5.0f} / {f['p99']:>5.0f} "
                          f"{row['behind_playback']:>6} {row['audio_s_per_s']:>9}", flush=True)  # fmt: skip
                    rows.append(row)
        finally:
            pool.close()
    if a.json:
        a.json.write_text(json.dumps({"cores": os.cpu_count(), "backend": a.backend, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
