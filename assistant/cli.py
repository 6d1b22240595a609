"""Text mode: ask the handbook from the terminal, by typing or by a recorded question, and hear the answer.

    python -m assistant.cli -q "How do I apply for annual leave?"
    python -m assistant.cli                      # interactive, multi-turn
    python -m assistant.cli --audio question.wav --voice answer.wav
    python -m assistant.cli --image receipt.jpg -q "Can I claim this?"
    python -m assistant.cli --docs DIR --model PATH --timings
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from assistant.config import HANDBOOK_DIR, AssistantConfig, EngineOptions, add_engine_arguments
from assistant.conversation import Conversation
from speech.chunker import Chunker

if TYPE_CHECKING:  # imported when used: the engine pulls in torch, which --help and bad arguments should not wait for
    import sounddevice

    from assistant.answerer import Answerer
    from assistant.image_reading import ImageText
    from speech.tts.base import TTSBackend

SPEAKERS = ""  # the value of a bare --voice
OUTPUT_RATE = 24000  # spoken answers: the hibari voice's rate; espeak-ng's 22.05 kHz is resampled to it
ASR_RATE = 16000


class VoiceUnavailable(RuntimeError):
    """The answer cannot be spoken here; the message says what to do instead."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m assistant.cli", description="Ask the company handbook (text mode).")
    ask = p.add_mutually_exclusive_group()
    ask.add_argument("-q", "--question", help="ask one question, print the streamed answer, exit")
    ask.add_argument("--audio", type=Path, metavar="FILE.wav", help="ask one question recorded in a WAV file (transcribed with Whisper)")
    p.add_argument(
        "--voice", nargs="?", const=SPEAKERS, metavar="OUT.wav",
        help="also speak the answer: to the speakers, or into OUT.wav if given (hibari voice; espeak-ng for Chinese)",
    )
    p.add_argument("--image", type=Path, action="append", default=[], metavar="FILE",
                   help="a picture (PNG, JPEG, WebP, ...) the question is about; its text is read (OCR) and goes with "
                        "the question (-q, --audio, or the first one typed); repeatable")  # fmt: skip
    p.add_argument("--docs", type=Path, default=HANDBOOK_DIR, help="documents folder (default: the bundled handbook)")
    p.add_argument("--model", type=Path, help="HF model directory or llama/qwen2 .gguf file (default: the embedded LLM, Qwen2.5-Coder-1.5B, or the role in $ASSISTANT_LLM, e.g. llm-qwen-0.5b)")
    p.add_argument("--lang", choices=("auto", "en", "zh"), default="auto", help="handbook language (default: from the question)")
    p.add_argument("--max-tokens", type=int, default=160, help="longest answer in tokens (default 160)")
    p.add_argument("--max-model-len", type=int, help="context length in tokens (default: the model's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (default)")
    add_engine_arguments(p)
    p.add_argument(
        "--timings", action="store_true",
        help="print the documents mode (whole-context or retrieval) and, per answer, TTFT, tokens/s and cached prompt tokens",
    )
    return p.parse_args(argv)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def check_args(args: argparse.Namespace) -> str | None:
    if not args.docs.is_dir():
        return f"--docs {args.docs}: no such directory"
    if args.model is not None and not args.model.exists():
        return f"--model {args.model}: no such file or directory"
    if args.question is not None and not args.question.strip():
        return "the question is empty"
    if args.audio is not None and not args.audio.is_file():
        return f"--audio {args.audio}: no such file"
    for image in args.image:
        if not image.is_file():
            return f"--image {image}: no such file"
    if args.voice and not Path(args.voice).resolve().parent.is_dir():
        return f"--voice {args.voice}: no such directory"
    if args.max_tokens < 1:
        return f"--max-tokens must be >= 1, got {args.max_tokens}"
    if args.max_model_len is not None and args.max_model_len <= args.max_tokens:
        return f"--max-model-len must be more than --max-tokens ({args.max_tokens}), got {args.max_model_len}"
    if args.temperature < 0:
        return f"--temperature must be >= 0, got {args.temperature}"
    return None


def read_images(paths: list[Path]) -> list[ImageText]:
    """The text of each picture, shown on stderr as read; ImageError (naming the file) if one
    cannot be taken or none has any text."""
    from assistant.image_reading import NO_TEXT, ImageError, ImageReading, check_count

    check_count(len(paths))
    reading, texts = ImageReading(), []
    for path in paths:
        try:
            text = reading.read(path.read_bytes())
        except ImageError as e:
            raise ImageError(e.code, f"--image {path}: {e}") from e
        print(f"[image {path.name}: {len(text.lines)} lines read in {text.read_ms:.0f} ms]", file=sys.stderr, flush=True)
        print("\n".join(f"  | {row}" for row in text.rows), file=sys.stderr, flush=True)
        texts.append(text)
    if not any(t.lines for t in texts):
        raise ImageError("image_no_text", f"--image: {NO_TEXT}")
    return texts


def read_question_audio(path: Path) -> np.ndarray:
    """A WAV file (PCM16, mono or stereo, any common rate) as 16 kHz mono float32; AudioFormatError if unusable."""
    from speech.audio import read_wav, resample

    samples, rate = read_wav(path)
    return resample(samples, rate, ASR_RATE)


def transcribe(samples: np.ndarray, language: str) -> str:
    """The question spoken in ``samples`` (16 kHz), by the embedded Whisper base model."""
    from assistant.models import resolve
    from speech.asr.factory import load_backend
    from speech.config import ASRConfig

    backend = load_backend(ASRConfig(model_path=resolve("asr"), language=language))
    return backend.transcribe(samples).text


def open_speakers() -> sounddevice.OutputStream:
    """A started sounddevice output stream at OUTPUT_RATE, or VoiceUnavailable saying what to do instead."""
    try:
        import sounddevice as sd
    except (ImportError, OSError) as e:
        raise VoiceUnavailable(
            f"--voice: speaking to the speakers needs sounddevice and PortAudio ({e}); pip install sounddevice, "
            "or write the answer to a file: --voice answer.wav"
        ) from e
    try:
        stream = sd.OutputStream(samplerate=OUTPUT_RATE, channels=1, dtype="float32")
        stream.start()
    except (sd.PortAudioError, ValueError) as e:
        raise VoiceUnavailable(f"--voice: no audio output device ({e}); write the answer to a file instead: --voice answer.wav") from e
    return stream


class Voice:
    """Speaks answers while they stream: speakable pieces (the speech chunker) -> TTS -> speakers or a WAV file.

    Pieces with Chinese characters are spoken by espeak-ng (Mandarin), the others by the bundled
    hibari voice. One worker thread synthesizes and plays them in order, so text keeps streaming.
    Into a file, every answer of the session is appended and the file rewritten after each one.
    """

    def __init__(self, wav_path: Path | None) -> None:
        self.wav_path = wav_path
        self._speakers = open_speakers() if wav_path is None else None
        self._backends = {"en": self._load("en")}  # load the default voice now: fail before the model loads
        self._recorded: list[np.ndarray] = []
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voice")
        self._chunker = Chunker()
        self._pending: list[asyncio.Future] = []

    @staticmethod
    def _load(language: str) -> TTSBackend:
        from assistant.models import resolve
        from speech.config import TTSConfig
        from speech.tts.factory import load_tts

        if language == "zh":
            return load_tts(TTSConfig(backend="espeak", language="zh"))
        return load_tts(TTSConfig(backend="hibari", model_path=resolve("tts")))

    def push(self, text: str) -> None:
        """Queue the pieces of the streamed answer that are complete so far."""
        for piece in self._chunker.push(text):
            self._say(piece)

    async def finish(self) -> None:
        """Speak the rest of this answer and wait until it has been played (or written)."""
        for piece in self._chunker.flush():
            self._say(piece)
        self._chunker = Chunker()
        pending, self._pending = self._pending, []
        await asyncio.gather(*pending)
        if self.wav_path is not None and self._recorded:
            from speech.audio import write_wav

            write_wav(self.wav_path, np.concatenate(self._recorded), OUTPUT_RATE)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
        if self._speakers is not None:
            self._speakers.stop()
            self._speakers.close()

    def _say(self, piece: str) -> None:
        if piece.strip():
            self._pending.append(asyncio.get_running_loop().run_in_executor(self._worker, self._speak, piece.strip()))

    def _speak(self, piece: str) -> None:  # on the worker thread
        from assistant.docs import detect_language
        from speech.audio import resample

        language = detect_language(piece)
        if language not in self._backends:
            self._backends[language] = self._load(language)
        for chunk in self._backends[language].stream(piece):
            pcm = chunk.pcm if chunk.sample_rate == OUTPUT_RATE else resample(chunk.pcm, chunk.sample_rate, OUTPUT_RATE)
            if self._speakers is not None:
                self._speakers.write(np.ascontiguousarray(pcm, np.float32).reshape(-1, 1))
            else:
                self._recorded.append(pcm)


async def ask(answerer: Answerer, question: str, conversation: Conversation, timings: bool, voice: Voice | None,
              gate: bool = True) -> None:  # fmt: skip
    """Stream one answer to stdout (and the voice), then its source; the turn joins ``conversation``.
    ``gate=False`` (a question with a picture's text) always asks the model (Answerer.answer)."""
    async for delta in answerer.answer(question, conversation, gate=gate):
        print(delta.text, end="", flush=True)
        if voice is not None:
            voice.push(delta.text)
        if delta.finished:
            print(flush=True)
            if delta.citation is not None:
                print(f"Source: {delta.citation}", flush=True)
            if timings:
                ttft = f"{delta.ttft_s * 1000:.0f} ms" if delta.ttft_s is not None else "n/a"
                rate = f"{delta.decode_tokens_per_s:.1f} tok/s" if delta.decode_tokens_per_s else "n/a"
                print(
                    f"[ttft {ttft} · {rate} · {delta.generated_tokens} tokens · prompt {delta.prompt_tokens} tokens, "
                    f"{delta.cached_tokens} cached · {delta.mode} · docs {delta.docs_version}]",
                    file=sys.stderr, flush=True,
                )
    if voice is not None:
        await voice.finish()


async def run(args: argparse.Namespace) -> int:
    from assistant.answerer import Answerer
    from assistant.docs import DocumentError
    from assistant.image_reading import ImageError
    from assistant.models import ModelNotAvailable
    from assistant.prompt import PromptTooLong
    from engine import ConfigError
    from speech.audio import AudioFormatError
    from speech.config import ConfigError as SpeechConfigError
    from speech.tts.base import TTSUnavailable

    question = args.question
    try:
        images = read_images(args.image) if args.image else []
    except ImageError as e:
        return fail(str(e))
    if args.audio is not None:
        try:
            samples = read_question_audio(args.audio)
        except AudioFormatError as e:
            return fail(f"--audio {args.audio}: {e}")
    config = AssistantConfig(
        docs_dir=args.docs, language=args.lang, max_tokens=args.max_tokens, temperature=args.temperature,
        engine=EngineOptions(model=args.model, device=args.device, quantization=args.quantization,
                             lm_head_quantization=args.lm_head_quantization, kv_cache_dtype=args.kv_cache_dtype,
                             speculative=args.speculative_decoding, draft_model=args.draft_model,
                             max_model_len=args.max_model_len),
    )
    voice = None
    try:
        if args.voice is not None:
            voice = Voice(Path(args.voice) if args.voice else None)
        if args.audio is not None:
            print("Transcribing the question...", file=sys.stderr, flush=True)
            question = transcribe(samples, args.lang)
            if not question.strip():
                return fail(f"--audio {args.audio}: no speech recognised")
            print(f"> {question}", flush=True)
        print("Loading the model and the handbook...", file=sys.stderr, flush=True)
        try:
            answerer = Answerer.create(config)
        except (DocumentError, FileNotFoundError, ConfigError, ValueError) as e:
            return fail(str(e))
        try:
            return await converse(answerer, question, args.timings, voice, Conversation(), images)
        except PromptTooLong as e:
            return fail(str(e))
        finally:
            answerer.shutdown()
    except VoiceUnavailable as e:
        return fail(str(e))
    except (ModelNotAvailable, TTSUnavailable, SpeechConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if voice is not None:
            voice.close()


async def converse(answerer: Answerer, question: str | None, timings: bool, voice: Voice | None, conversation: Conversation,
                   images: Sequence[ImageText] = ()) -> int:  # fmt: skip
    """Answer ``question`` and return, or (None) read questions from stdin until an empty line or EOF.
    The text of ``images`` goes with the first question."""
    from assistant.image_reading import image_prompt
    from assistant.prompt import PromptTooLong

    if timings:
        for lang, builder in answerer.builders.items():
            print(f"[handbook {lang}: {builder.summary()}]", file=sys.stderr, flush=True)
    if question is not None:
        await ask(answerer, image_prompt(images, question) if images else question, conversation, timings, voice, gate=not images)
        return 0
    print("Ask a question about the handbook (empty line or Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            question = await asyncio.to_thread(input, "> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not question.strip():
            return 0
        gate = not images
        if images:
            question, images = image_prompt(images, question), ()
        try:
            await ask(answerer, question, conversation, timings, voice, gate=gate)
        except PromptTooLong as e:
            print(f"error: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    error = check_args(args)
    if error:
        return fail(error)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
