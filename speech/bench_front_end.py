"""The audio front end's CPU cost per caller: ``python -m speech.bench_front_end [--chunk-ms 40] [--json F]``.

Every audio packet a caller sends is resampled to 16 kHz and scored by the VAD (webrtcvad, then
Silero's ONNX model) before Whisper sees it, on a thread of the server's one process. ONNX Runtime
releases the GIL while the model runs; everything else holds it, and one GIL is shared by all
callers, the event loop and the voice workers. This program feeds a spoken question packet by
packet and prints, per packet, the time in each part and the GIL-held time, and from it the
ceiling: how many callers one GIL can keep up with in real time (packet length / GIL-held time),
before any other work of the process. Baseline, in the same run: webrtcvad alone (no Silero).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speech.audio import Resampler, to_float32, to_pcm16
from speech.config import TTSConfig, VADConfig
from speech.vad import VoiceActivityDetector

QUESTION = "How many days of annual leave do I get per year, and how do I apply for it?"


@dataclass
class FrontEndCost:
    """Microseconds per packet, averaged over the run."""

    variant: str
    packets: int
    resample_us: float
    vad_us: float
    onnx_us: float  # inside ONNX Runtime's run (the GIL is released there)
    gil_us: float  # everything else: held the GIL
    callers_per_gil: float  # packet length / gil_us: the real-time ceiling of one process
    callers_per_core: float  # packet length / (resample + VAD): the ceiling of one core


class _TimedSession:
    """Wraps an ONNX Runtime session and adds up the time spent in ``run``."""

    def __init__(self, session: Any) -> None:
        self.session, self.seconds = session, 0.0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.session.run(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def spoken_audio(seconds: float, rate: int) -> np.ndarray:
    """The bundled voice saying ``QUESTION`` with 0.5 s of silence after it, repeated to ``seconds``."""
    from speech.tts import load_tts

    tts = load_tts(TTSConfig(backend="hibari", seed=0, workers=1))
    speech = tts.synthesize(QUESTION).pcm
    if tts.sample_rate != rate:
        resampler = Resampler(tts.sample_rate, rate)
        speech = np.concatenate([resampler.process(speech), resampler.flush()])
    once = np.concatenate([speech, np.zeros(rate // 2, np.float32)])
    return np.tile(once, int(np.ceil(seconds * rate / len(once))))[: round(seconds * rate)]


def measure(audio: np.ndarray, rate: int, chunk_ms: int, silero: bool) -> FrontEndCost:
    """Feed ``audio`` (float32 at ``rate``) in ``chunk_ms`` PCM16 packets through one caller's front end."""
    resampler = Resampler(rate, VADConfig.sample_rate)
    vad = VoiceActivityDetector(VADConfig(use_silero=silero))
    timed = None
    if silero:
        timed = vad._silero._session = _TimedSession(vad._silero._session)  # type: ignore[union-attr]  # the bench's probe
    pcm = to_pcm16(audio).astype("<i2").tobytes()
    step = rate * chunk_ms // 1000 * 2
    resample_s = vad_s = 0.0
    packets = 0
    for k in range(0, len(pcm) - step + 1, step):
        t0 = time.perf_counter()
        samples = resampler.process(to_float32(pcm[k : k + step]))
        t1 = time.perf_counter()
        vad.process(samples)
        t2 = time.perf_counter()
        resample_s, vad_s, packets = resample_s + t1 - t0, vad_s + t2 - t1, packets + 1
    onnx_s = timed.seconds if timed else 0.0
    per = 1e6 / packets
    gil_us = (resample_s + vad_s - onnx_s) * per
    return FrontEndCost(
        "webrtcvad + Silero" if silero else "webrtcvad only (baseline)", packets, round(resample_s * per, 1), round(vad_s * per, 1),
        round(onnx_s * per, 1), round(gil_us, 1), round(chunk_ms * 1000 / gil_us, 1), round(chunk_ms * 1000 / ((resample_s + vad_s) * per), 1),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speech.bench_front_end", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk-ms", type=int, default=40, help="packet length, as callers send it (default 40)")
    p.add_argument("--input-rate", type=int, default=24000, help="the callers' sample rate (default 24000, the Realtime API's)")
    p.add_argument("--seconds", type=float, default=30.0, help="audio fed per variant (default 30)")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args(argv)
    if a.chunk_ms < 10 or a.seconds <= 0:
        p.error("--chunk-ms must be >= 10 and --seconds > 0")
    audio = spoken_audio(a.seconds, a.input_rate)
    rows = [measure(audio, a.input_rate, a.chunk_ms, silero) for silero in (True, False)]
    print(f"# {a.seconds:g} s of speech at {a.input_rate} Hz in {a.chunk_ms} ms packets; {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}")  # fmt: skip
    print("| front end | µs/packet resample | VAD | of which ONNX (GIL free) | GIL held | callers per GIL (ceiling) | callers per core |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.variant} | {r.resample_us} | {r.vad_us} | {r.onnx_us} | {r.gil_us} | {r.callers_per_gil} | {r.callers_per_core} |")
    if a.json:
        a.json.write_text(json.dumps({"chunk_ms": a.chunk_ms, "input_rate": a.input_rate, "seconds": a.seconds,
                                      "results": [asdict(r) for r in rows]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
