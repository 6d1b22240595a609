"""Speech benchmark: ASR real-time factor and final latency, TTS first-chunk time and RTF.

    python -m speech.bench --asr-model base=DIR [--asr-model tiny.en=DIR] [--json out.json]

ASR: questions of 2-8 s spoken by the bundled voice go through the whole streaming path
(resampling, VAD, the shared worker) paced in real time in 20 ms packets, once with partials and
once without; "final latency" is wall time from the endpoint decision to the final transcript.
Its baseline is a plain decode of the same audio measured in the same run. TTS: time to the first
chunk and real-time factor per backend (coqui runs a small random-weight VITS unless
``--coqui-checkpoint`` is given: its audio is noise, only its speed means anything).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from speech.asr.backend import FasterWhisperBackend
from speech.asr.session import ASRSession
from speech.asr.worker import ASRWorker
from speech.audio import resample
from speech.config import ASRConfig, TTSConfig
from speech.messages import SpeechEnded, Transcript
from speech.tts import TTSUnavailable, load_tts

UTTERANCES = [
    "How many days of annual leave do I get per year?",
    "How quickly must I report a security incident, and which form do I submit?",
    "To apply for annual leave, open PeopleHub, choose a leave request, and submit it to your "
    "manager.",
    "If you are sick for more than three days, send a doctor's note to your manager and record "
    "the absence in PeopleHub on the same day.",
]
ANSWER = (
    "You get twenty five days of annual leave per year. Apply in PeopleHub at least two weeks "
    "ahead, and your manager approves the request. Up to five unused days carry over."
)
PACKET_S = 0.02
RATE = 16000


@dataclass
class Row:
    """One measured figure and the reference it is read against."""

    stage: str
    subject: str
    metric: str
    value: float
    unit: str
    reference: str


def speech_seconds(audio: np.ndarray) -> float:
    """Duration of the voiced part (10 ms envelope within 40 dB of its peak)."""
    envelope = np.sqrt(np.convolve(audio.astype(np.float64) ** 2, np.ones(160) / 160, "same"))
    loud = np.nonzero(envelope > envelope.max() * 0.01)[0]
    return (loud[-1] - loud[0]) / RATE


def stream_once(worker: ASRWorker, config: ASRConfig, audio: np.ndarray) -> dict[str, float]:
    """Feed ``audio`` in real time; seconds from the endpoint to the final, and partial count."""
    marks: dict[str, float] = {"partials": 0}
    done = threading.Event()

    def on_event(event) -> None:
        now = time.perf_counter()
        if isinstance(event, SpeechEnded):
            marks["endpoint"] = now
        elif isinstance(event, Transcript):
            if event.is_final:
                marks["final"] = now
                done.set()
            else:
                marks["partials"] += 1

    session = ASRSession(worker, on_event, config)
    step = round(PACKET_S * RATE)
    start = time.perf_counter()
    for n, i in enumerate(range(0, len(audio), step)):
        time.sleep(max(0.0, start + n * PACKET_S - time.perf_counter()))
        session.feed(audio[i : i + step])
    if not done.wait(120):
        raise RuntimeError("no final transcript within 120 s")
    return {"latency": marks["final"] - marks["endpoint"], "partials": marks["partials"]}


def bench_asr(
    name: str, path: Path, clips: list[np.ndarray], threads: int, repeats: int, bar: tqdm
) -> list[Row]:
    config = ASRConfig(model_path=path, language="en", cpu_threads=threads)
    backend = FasterWhisperBackend(config)
    backend.transcribe(clips[0])  # warm-up
    rows = []
    with ASRWorker(backend, config.queue_size) as worker:
        for audio in clips:
            speech = speech_seconds(audio)
            length = f"{speech:.1f} s"
            decodes = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                backend.transcribe(audio)
                decodes.append(time.perf_counter() - t0)
            decode = statistics.median(decodes)
            streamed = {
                label: [stream_once(worker, cfg, audio) for _ in range(repeats)]
                for label, cfg in (
                    ("without", replace(config, partial_interval_s=None)),
                    ("with", config),
                )
            }
            latency = {k: statistics.median(r["latency"] for r in v) for k, v in streamed.items()}
            partials = statistics.median(r["partials"] for r in streamed["with"])
            rows += [
                Row("ASR", name, f"RTF, {length} utterance", decode / speech, "x",
                    "1.0 = real time"),
                Row("ASR", name, f"final latency after endpoint, {length}, no partials",
                    latency["without"] * 1e3, "ms", f"plain decode {decode * 1e3:.0f} ms"),
                Row("ASR", name,
                    f"final latency after endpoint, {length}, "
                    f"partials every {config.partial_interval_s} s ({partials:.0f} emitted)",
                    latency["with"] * 1e3, "ms", f"plain decode {decode * 1e3:.0f} ms"),
            ]  # fmt: skip
            bar.update()
    return rows


def bench_tts(config: TTSConfig, label: str, repeats: int, bar: tqdm) -> list[Row]:
    tts = load_tts(config)
    tts.synthesize("Warm up.")
    firsts, rtfs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        first, audio_s = None, 0.0
        for chunk in tts.stream(ANSWER):
            first = first if first is not None else time.perf_counter() - t0
            audio_s += chunk.duration_s
        firsts.append(first)
        rtfs.append((time.perf_counter() - t0) / audio_s)
    bar.update()
    return [
        Row("TTS", label, "time to first chunk", statistics.median(firsts) * 1e3, "ms",
            f"first piece of a {len(ANSWER)}-character answer"),
        Row("TTS", label, "RTF", statistics.median(rtfs), "x", "1.0 = real time"),
    ]  # fmt: skip


def random_vits(directory: Path) -> Path:
    """A small random-weight VITS checkpoint (its audio is noise; for timing only)."""
    import torch
    from TTS.tts.configs.shared_configs import CharactersConfig
    from TTS.tts.configs.vits_config import VitsArgs, VitsConfig
    from TTS.tts.models.vits import Vits

    args = VitsArgs(
        hidden_channels=32, hidden_channels_ffn_text_encoder=64, num_layers_text_encoder=2,
        num_layers_flow=2, num_layers_posterior_encoder=2, use_sdp=False,
        init_discriminator=False, upsample_initial_channel_decoder=32,
        upsample_rates_decoder=[8, 8, 4], upsample_kernel_sizes_decoder=[16, 16, 8],
        resblock_kernel_sizes_decoder=[3], resblock_dilation_sizes_decoder=[[1, 3, 5]],
    )  # fmt: skip
    characters = CharactersConfig(
        characters_class="TTS.tts.models.vits.VitsCharacters", pad="_", eos="", bos="",
        blank=None, characters="abcdefghijklmnopqrstuvwxyz ", punctuations=".,!?;:'-",
        phonemes=None, is_unique=True, is_sorted=True,
    )  # fmt: skip
    config = VitsConfig(
        model_args=args, use_phonemes=False, text_cleaner="english_cleaners",
        characters=characters, add_blank=False,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.save({"model": Vits(config).state_dict()}, directory / "model.pth")
    config.save_json(str(directory / "config.json"))
    return directory


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("faster-whisper", "ctranslate2", "webrtcvad-wheels", "onnxruntime",
                    "hibari-tts", "coqui-tts", "torch", "numpy", "av"):  # fmt: skip
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(
        prog="python -m speech.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--asr-model", action="append", default=[], metavar="NAME=DIR",
                        help="a CTranslate2 Whisper directory to measure (repeatable)")
    parser.add_argument("--coqui-checkpoint", type=Path,
                        help="a coqui checkpoint directory (default: a random-weight VITS)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for Whisper")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    models = [tuple(spec.split("=", 1)) for spec in args.asr_model]
    if any(len(m) != 2 for m in models):
        parser.error("--asr-model takes NAME=DIR")

    voice = load_tts(TTSConfig(backend="hibari", seed=0))
    pad = np.zeros(RATE // 2, np.float32)
    clips = [
        np.concatenate(
            [pad, resample(voice.synthesize(text).pcm, voice.sample_rate, RATE), pad, pad]
        )
        for text in UTTERANCES
    ]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp, tqdm(
        total=len(models) * len(clips) + 3, desc="speech bench", unit="step"
    ) as bar:
        for name, path in models:
            rows += bench_asr(name, Path(path), clips, args.threads, args.repeats, bar)
        rows += bench_tts(TTSConfig(backend="hibari"), "hibari (bundled voice)", args.repeats, bar)
        rows += bench_tts(TTSConfig(backend="espeak"), "espeak-ng", args.repeats, bar)
        try:
            checkpoint = args.coqui_checkpoint or random_vits(Path(tmp))
            label = "coqui" if args.coqui_checkpoint else "coqui, random small VITS (noise)"
            rows += bench_tts(
                TTSConfig(backend="coqui", model_path=checkpoint), label, args.repeats, bar
            )
        except (ImportError, TTSUnavailable):
            bar.write("coqui-tts is not installed: pip install 'handbook-voice-assistant[coqui]'")

    table = Table(title="Speech benchmark (CPU)")
    for column in ("stage", "model / backend", "metric", "measured", "reference"):
        table.add_column(column)
    for row in rows:
        value = f"{row.value:.3f} x" if row.unit == "x" else f"{row.value:.0f} {row.unit}"
        table.add_row(row.stage, row.subject, row.metric, value, row.reference)
    Console(width=160).print(table)
    if args.json:
        payload = {"versions": versions(), "machine": platform.processor() or platform.machine(),
                   "rows": [asdict(r) for r in rows]}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))
    return rows


if __name__ == "__main__":
    main()
