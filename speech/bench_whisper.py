"""Time the PyTorch Whisper backend on one device: encoder, decode steps, clips/s per batch size.

    python -m speech.bench_whisper --model DIR [--device cuda] [--batch 1,8,32] [--clip WAV --expect TEXT]
    python -m speech.bench_whisper --load-format dummy [--device cuda] [--batch 1,8,32,64]

For each batch size: encoder ms per 30 s window, decode ms per step (a step is one token of every
row), and whole clips per second through ``transcribe_batch``, in three modes: "graphs" (the
encoder and ``graph_steps`` decoder steps a replay from CUDA graphs: the server's default),
"step" (the decoder one step a replay, the encoder eager: the earlier default) and "eager". On a
GPU it first checks that the encoder's graph replay gives the eager encoder's output. With real weights it first checks that the clip's transcript is
the expected text (exit status 1 if not). The clip is a spoken handbook question (synthesized by
the bundled voice unless ``--clip`` is given). ``--load-format dummy`` times the large-v3-turbo
shape with random weights: every decode runs exactly ``--dummy-tokens`` tokens. Needs only numpy,
torch and tokenizers (plus the voice when no ``--clip`` is given).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from speech.asr.encoder_graphs import EncoderGraphs
from speech.asr.greedy_decode import GreedyDecoder
from speech.asr.torch_backend import TorchWhisperBackend
from speech.audio import read_wav, resample
from speech.config import ASRConfig

QUESTION = "How many days of annual leave do I get each year?"


def spoken_question(path: Path | None) -> np.ndarray:
    """The clip at 16 kHz: ``path``, or the question spoken by the bundled voice with 0.5 s of silence each side."""
    if path is not None:
        audio, rate = read_wav(path)
    else:
        from speech.config import TTSConfig
        from speech.tts import load_tts

        try:
            tts = load_tts(TTSConfig(backend="hibari", seed=0))
        except Exception as exc:  # the voice (or PyAV for its 24 kHz) is not installed here
            raise SystemExit(f"cannot synthesize the question ({exc}); give --clip WAV (16 kHz) and --expect TEXT")
        audio, rate = tts.synthesize(QUESTION).pcm, tts.sample_rate
    if rate != 16000:
        audio = resample(audio, rate, 16000)
    silence = np.zeros(8000, np.float32)
    return np.concatenate([silence, audio, silence])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run, repeats: int) -> float:
    """Median seconds of ``run()`` over ``repeats`` runs (after one warm-up run)."""
    run()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(backend: TorchWhisperBackend, clip: np.ndarray, batch: int, repeats: int) -> dict[str, float]:
    """Encoder ms/window, decode ms/step and clips/s for ``batch`` copies of ``clip``."""
    device = backend.torch_device
    with torch.inference_mode(), backend.decoder.stream_context():
        windows = backend.mel.windows([clip] * batch)
        encode_s = timed(device, lambda: backend.encoder.encode(windows.features), repeats)
        audio = backend.encoder.encode(windows.features)
        prompts = [backend._prompt(backend._language(None), "", None) for _ in range(batch)]
        decode_s = timed(device, lambda: backend.decoder.decode(audio, prompts), repeats)
        steps = backend.decoder.steps_run
    clips_s = timed(device, lambda: backend.transcribe_batch([(clip, "", None)] * batch), repeats)
    return {
        "batch": batch,
        "encoder_ms_per_window": 1000 * encode_s / batch,
        "decode_steps": steps,
        "decode_ms_per_step": 1000 * decode_s / max(1, steps),
        "clips_per_s": batch / clips_s,
        "ms_per_batch": 1000 * clips_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speech.bench_whisper", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a CTranslate2 Whisper directory (with --load-format dummy: only its tokenizer)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--batch", default="1,8,32", help="batch sizes, comma-separated (default 1,8,32)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--dummy-tokens", type=int, default=24)
    p.add_argument("--clip", type=Path, help="a WAV file to transcribe (default: the question spoken by the bundled voice)")
    p.add_argument("--expect", default=QUESTION, help="the clip's expected transcript (real weights)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", default="graphs,step,eager", help="modes to time, comma-separated (default graphs,step,eager)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    if a.load_format == "auto" and a.model is None:
        p.error("--model DIR is needed unless --load-format dummy")
    batches = [int(b) for b in a.batch.split(",")]
    config = ASRConfig(model_path=a.model, backend="torch", device=a.device, language="en", load_format=a.load_format,
                       dummy_tokens=a.dummy_tokens, max_batch=max(batches))  # fmt: skip
    started = time.perf_counter()
    backend = TorchWhisperBackend(config)
    dims = backend.model.dims
    print(f"device {backend.device} ({torch.cuda.get_device_name(backend.torch_device) if backend.torch_device.type == 'cuda' else 'cpu'}), "
          f"{a.load_format} weights: {dims.n_audio_layer}+{dims.n_text_layer} layers, d={dims.n_audio_state}, "
          f"{dims.n_mels} mels; loaded and captured in {time.perf_counter() - started:.1f} s")  # fmt: skip
    clip = spoken_question(a.clip)
    status = 0
    if a.load_format == "auto":
        heard = backend.transcribe(clip).text
        ok = heard.strip() == a.expect.strip()
        status = 0 if ok else 1
        print(f"transcript {'OK' if ok else 'MISMATCH'}: {heard!r}" + ("" if ok else f" (expected {a.expect!r})"))
    graphs_decoder, graphs_encoder = backend.decoder, backend.encoder
    eager_encoder = EncoderGraphs(backend.model, graphs_encoder.max_batch, enabled=False)
    if graphs_encoder.captured:
        with torch.inference_mode(), graphs_decoder.stream_context():
            mel = backend.mel.windows([clip] * max(batches)).features
            diff = (graphs_encoder.encode(mel) - eager_encoder.encode(mel)).abs().max().item()
        print(f"encoder graph replay vs eager: max |difference| {diff:.3g}")
        status = status or int(not diff <= 1e-2)
    rows = []
    for mode in a.modes.split(","):
        if mode != "eager" and not graphs_decoder.use_graphs:
            print(f"{mode}: not on this device (CUDA graphs are CUDA only)")
            continue
        if mode == "graphs":
            backend.decoder, backend.encoder = graphs_decoder, graphs_encoder
        else:
            backend.decoder = GreedyDecoder(backend.model, graphs_decoder.rules, graphs_decoder.max_batch,
                                            cuda_graphs=mode == "step", stream=graphs_decoder.stream, steps_per_graph=1)  # fmt: skip
            backend.decoder.capture()
            backend.encoder = eager_encoder
        for batch in batches:
            row = {"mode": mode, **measure(backend, clip, batch, a.repeats)}
            rows.append(row)
            print(f"{mode:6s} batch {batch:3d}: encoder {row['encoder_ms_per_window']:7.2f} ms/window  "
                  f"decode {row['decode_ms_per_step']:6.2f} ms/step ({row['decode_steps']} steps)  "
                  f"{row['clips_per_s']:8.1f} clips/s  ({row['ms_per_batch']:.1f} ms a batch)")  # fmt: skip
    backend.decoder, backend.encoder = graphs_decoder, graphs_encoder
    if a.json:
        a.json.write_text(json.dumps({"device": str(backend.device), "load_format": a.load_format,
                                      "dims": asdict(dims),
                                      "command": " ".join(sys.argv), "rows": rows}, indent=2))  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
