"""The audio front end's CPU cost per caller: ``python -m speech.bench_front_end [--chunk-ms 40] [--callers 1,16,64] [--json F]``.

Every audio packet a caller sends is resampled to 16 kHz and scored by the VAD (webrtcvad, then
Silero's ONNX model) before Whisper sees it, on a thread of the server's one process. ONNX Runtime
releases the GIL while the model runs; everything else holds it, and one GIL is shared by all
callers, the event loop and the voice workers. This program feeds a spoken question packet by
packet and prints, per packet, the time in each part and the GIL-held time, and from it the
ceiling: how many callers one GIL can keep up with in real time (packet length / GIL-held time),
before any other work of the process. Baseline, in the same run: webrtcvad alone (no Silero).

``--callers N[,N...]``: N callers at once, each on a thread of its own feeding its packets one
after another as fast as they go (the same cadence for all, not real time), through the shared
Silero scorer that batches all callers' windows into one ONNX call (``speech.silero_batch``, as
the ASR worker runs it) and, as the baseline in the same run, through a Silero session per caller
(one call per caller per packet, batch 1). Times are CPU times from the callers' thread clocks
(``time.thread_time``; ONNX Runtime runs on the calling thread): per packet, the GIL-held part
(all but the ONNX calls) and the ONNX part, with the ceilings packet length / GIL-held time
(callers per GIL) and packet length / both (callers per core).

``--processes N``: with ``--callers``, also the server process's share when the front ends run
in N worker processes (``speech.front_end.FrontEndPool``): the callers' threads' CPU time per
packet (checking the packet, the pipe round trip, reading the reply), against the same callers'
front ends in this process (shared Silero scorer) in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speech.audio import Resampler, to_float32, to_pcm16
from speech.config import TTSConfig, VADConfig
from speech.front_end import FrontEndPool, LocalFrontEnd
from speech.silero_batch import SileroScorer
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


@dataclass
class CallersCost:
    """CPU microseconds per packet with ``callers`` callers fed at once, averaged over all packets."""

    variant: str
    callers: int
    packets: int  # all callers' packets
    gil_us: float  # the callers' threads outside ONNX Runtime: held the GIL
    onnx_us: float  # inside ONNX Runtime's run (the GIL is released there)
    onnx_calls_per_packet: float
    windows_per_call: float
    callers_per_gil: float  # packet length / gil_us
    callers_per_core: float  # packet length / (gil_us + onnx_us)
    wall_s: float  # the whole run, on however many cores the machine lent it


class _TimedSession:
    """Wraps an ONNX Runtime session and adds up the time spent in ``run`` (``clock``: wall or
    thread CPU time) and the windows (input rows) it scored."""

    def __init__(self, session: Any, clock: Any = time.perf_counter) -> None:
        self.session, self.clock, self.seconds, self.calls, self.windows = session, clock, 0.0, 0, 0

    def run(self, output_names: Any, inputs: dict[str, np.ndarray], *args: Any) -> Any:
        t0 = self.clock()
        try:
            return self.session.run(output_names, inputs, *args)
        finally:
            self.seconds += self.clock() - t0
            self.calls, self.windows = self.calls + 1, self.windows + len(inputs["input"])


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


def feed_callers(audio: np.ndarray, rate: int, chunk_ms: int, callers: int, feed: Callable[[int, bytes], object],
                 close: Callable[[int], object]) -> tuple[list[float], float, int]:
    """``callers`` callers, each on a thread of its own: caller ``i`` sends ``audio`` (at ``rate``)
    shifted by ``i`` sevenths of a second, so callers say different things at once, in
    ``chunk_ms`` PCM16 packets through ``feed(i, packet)`` as fast as they go, then ``close(i)``.
    Returns each caller's thread CPU seconds, the run's wall seconds and the packets per caller."""
    step = rate * chunk_ms // 1000
    pcm = to_pcm16(audio).astype("<i2")
    packets = len(pcm) // step
    cpu_s = [0.0] * callers
    start = threading.Barrier(callers + 1)

    def caller(i: int) -> None:
        mine = np.roll(pcm, i * rate // 7).tobytes()
        start.wait()
        t0 = time.thread_time()
        for k in range(packets):
            feed(i, mine[k * step * 2 : (k + 1) * step * 2])
        cpu_s[i] = time.thread_time() - t0
        close(i)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    start.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    return cpu_s, time.perf_counter() - t0, packets


def measure_callers(audio: np.ndarray, rate: int, chunk_ms: int, callers: int, batched: bool, wait_ms: float) -> CallersCost:
    """``callers`` callers, each feeding ``audio`` (shifted, so they say different things at once)
    on a thread of its own; Silero through one shared scorer (``batched``) or a session each."""
    config = VADConfig(silero_batch_wait_ms=wait_ms)
    scorer = SileroScorer(config.silero_model, wait_ms) if batched else None
    vads = [VoiceActivityDetector(config, scorer) for _ in range(callers)]
    if scorer is not None:
        timed = [_TimedSession(scorer._session, time.thread_time)]
        scorer._session = timed[0]  # the bench's probe
    else:
        timed = [_TimedSession(vad._silero._session, time.thread_time) for vad in vads]  # type: ignore[union-attr]
        for vad, probe in zip(vads, timed):
            vad._silero._session = probe  # type: ignore[union-attr]
    resamplers = [Resampler(rate, VADConfig.sample_rate) for _ in range(callers)]
    cpu_s, wall_s, packets = feed_callers(
        audio, rate, chunk_ms, callers, lambda i, packet: vads[i].process(resamplers[i].process(to_float32(packet))),
        lambda i: vads[i].close(),
    )
    total = packets * callers
    onnx_s, calls, windows = (sum(getattr(t, name) for t in timed) for name in ("seconds", "calls", "windows"))
    gil_us, onnx_us = (sum(cpu_s) - onnx_s) * 1e6 / total, onnx_s * 1e6 / total
    return CallersCost(
        "shared scorer (batched)" if batched else "session per caller (batch 1, baseline)", callers, total,
        round(gil_us, 1), round(onnx_us, 1), round(calls / total, 3), round(windows / max(1, calls), 2),
        round(chunk_ms * 1000 / gil_us, 1), round(chunk_ms * 1000 / (gil_us + onnx_us), 1), round(wall_s, 2),
    )  # fmt: skip


@dataclass
class ServerShare:
    """CPU microseconds per packet spent on the callers' threads of the server's process."""

    where: str
    callers: int
    packets: int
    server_us: float  # the callers' threads' CPU time per packet (in-process: ONNX included)
    callers_per_core: float  # packet length / server_us
    wall_s: float


def measure_server_share(audio: np.ndarray, rate: int, chunk_ms: int, callers: int, processes: int) -> ServerShare:
    """``callers`` callers on a thread each, their front ends in ``processes`` worker processes
    (0: in this process, Silero through the shared scorer, as the server runs them without a pool)."""
    config = VADConfig()
    pool = FrontEndPool(processes) if processes else None
    scorer = None if pool else SileroScorer(config.silero_model, config.silero_batch_wait_ms)
    fronts = [pool.open(rate, config) if pool else LocalFrontEnd(rate, config, scorer) for _ in range(callers)]
    cpu_s, wall_s, packets = feed_callers(
        audio, rate, chunk_ms, callers, lambda i, packet: fronts[i].hear(packet), lambda i: fronts[i].close(),
    )
    if pool is not None:
        pool.close()
    per = sum(cpu_s) * 1e6 / (packets * callers)
    where = f"{processes} worker process{'es' if processes > 1 else ''}" if processes else "this process (baseline)"
    return ServerShare(where, callers, packets * callers, round(per, 1), round(chunk_ms * 1000 / per, 1), round(wall_s, 2))


def callers_list(text: str) -> list[int]:
    """``--callers``: comma-separated positive counts."""
    counts = [int(part) for part in text.split(",")]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give caller counts >= 1, e.g. 1,16,64")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speech.bench_front_end", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk-ms", type=int, default=40, help="packet length, as callers send it (default 40)")
    p.add_argument("--input-rate", type=int, default=24000, help="the callers' sample rate (default 24000, the Realtime API's)")
    p.add_argument("--seconds", type=float, default=30.0, help="audio fed per variant (default 30)")
    p.add_argument("--callers", type=callers_list, default=[], help="also feed N callers at once, for each N (e.g. 1,16,64)")
    p.add_argument("--batch-wait-ms", type=float, default=VADConfig.silero_batch_wait_ms,
                   help=f"the shared scorer's wait for the other callers (default {VADConfig.silero_batch_wait_ms}, VADConfig's)")
    p.add_argument("--processes", type=int, default=0, help="with --callers: also the front ends in this many worker processes")
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
    many = [measure_callers(audio, a.input_rate, a.chunk_ms, n, batched, a.batch_wait_ms)
            for n in a.callers for batched in (True, False)]  # fmt: skip
    if many:
        print(f"\n# Callers at once, one thread each, {a.seconds:g} s of audio each, packets as fast as they go; CPU µs per packet "
              f"(thread clocks); shared scorer's wait {a.batch_wait_ms:g} ms")  # fmt: skip
        print("| Silero | callers | µs/packet GIL held | ONNX (GIL free) | ONNX calls per packet | windows per call "
              "| callers per GIL (ceiling) | callers per core | wall s |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in many:
            print(f"| {c.variant} | {c.callers} | {c.gil_us} | {c.onnx_us} | {c.onnx_calls_per_packet} | {c.windows_per_call} "
                  f"| {c.callers_per_gil} | {c.callers_per_core} | {c.wall_s} |")  # fmt: skip
    shares = [measure_server_share(audio, a.input_rate, a.chunk_ms, n, processes)
              for n in a.callers for processes in ((a.processes, 0) if a.processes else ())]  # fmt: skip
    if shares:
        print(f"\n# The server process's share: the callers' threads' CPU µs per packet, front ends in {a.processes} worker "
              "process(es) vs in this process")  # fmt: skip
        print("| front ends in | callers | µs/packet in the server process | callers per core of it | wall s |")
        print("|---|---:|---:|---:|---:|")
        for sh in shares:
            print(f"| {sh.where} | {sh.callers} | {sh.server_us} | {sh.callers_per_core} | {sh.wall_s} |")
    if a.json:
        a.json.write_text(json.dumps({"chunk_ms": a.chunk_ms, "input_rate": a.input_rate, "seconds": a.seconds,
                                      "batch_wait_ms": a.batch_wait_ms, "results": [asdict(r) for r in rows],
                                      "callers": [asdict(c) for c in many], "server_share": [asdict(s) for s in shares]},
                                     indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
