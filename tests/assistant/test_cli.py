"""The text-mode CLI, run as a real subprocess on the embedded model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import wave

import numpy as np
import pytest

from tests.conftest import REPO


def cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "assistant.cli", *args], cwd=REPO, input=stdin, capture_output=True, text=True, timeout=timeout, env=env
    )


def small_docs(tmp_path):
    (tmp_path / "leave.md").write_text(
        "# Annual leave\nEmployees get 20 days of annual leave. Apply with form HR-01 in PeopleHub.\n", encoding="utf-8"
    )
    return tmp_path


def test_interactive_mode_caches_the_documents_prefix_across_turns(tmp_path):
    r = cli("--docs", str(small_docs(tmp_path)), "--timings", "--max-tokens", "12", stdin="How many days?\nWhich form?\n")
    assert r.returncode == 0, r.stderr
    timings = [line for line in r.stderr.splitlines() if line.startswith("[ttft")]
    assert len(timings) == 2
    cached_second = int(timings[1].split("tokens, ")[1].split(" cached")[0])
    assert cached_second > 0  # the second turn reused the documents (and first turn) KV


def test_missing_docs_folder_is_a_one_line_error_with_exit_code_2(tmp_path):
    r = cli("-q", "hi", "--docs", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no such directory" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_model_is_a_one_line_error_with_exit_code_2(tmp_path):
    r = cli("-q", "hi", "--model", str(tmp_path / "model.gguf"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no such file" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_folder_that_is_not_a_model_is_a_clear_error(tmp_path):
    r = cli("-q", "hi", "--model", str(tmp_path), "--docs", str(small_docs(tmp_path)))
    assert r.returncode == 2 and "is not a model" in r.stderr and "Traceback" not in r.stderr


def test_a_draft_model_answers_as_the_model_alone(tmp_path, llm_gguf_path, qwen_0_5b_gguf):
    """--speculative-decoding draft: the model drafting for itself gives the answer plain decoding
    gives; a draft model of another tokenizer, or a draft model without draft decoding, is a
    one-line error."""
    docs = str(small_docs(tmp_path))
    common = ("-q", "How many days of annual leave do I get?", "--docs", docs, "--max-tokens", "16", "--model", str(llm_gguf_path))
    plain = cli(*common, "--speculative-decoding", "off")
    drafted = cli(*common, "--speculative-decoding", "draft", "--draft-model", str(llm_gguf_path))
    assert plain.returncode == drafted.returncode == 0, plain.stderr[-2000:] + drafted.stderr[-2000:]
    assert drafted.stdout == plain.stdout and "20" in plain.stdout
    wrong = cli(*common, "--speculative-decoding", "draft", "--draft-model", str(qwen_0_5b_gguf))
    assert wrong.returncode == 2 and "another tokenizer" in wrong.stderr and "Traceback" not in wrong.stderr
    unused = cli(*common, "--draft-model", str(llm_gguf_path))
    assert unused.returncode == 2 and "--speculative-decoding draft" in unused.stderr and "Traceback" not in unused.stderr


def test_an_e4m3_head_answers_and_is_refused_over_the_cpus_int4_head(tmp_path, llm_gguf_path):
    """--lm-head-quantization fp8 reaches the engine: over dense layers the head runs in e4m3 and
    the answer still comes; over the CPU's int4 layers (the default there), whose head is already
    the GGUF's 4-bit one, it is a one-line error that names the setting."""
    docs = str(small_docs(tmp_path))
    common = ("-q", "How many days of annual leave do I get?", "--docs", docs, "--max-tokens", "16", "--model", str(llm_gguf_path))
    dense = cli(*common, "--quantization", "none", "--lm-head-quantization", "fp8")
    assert dense.returncode == 0 and "20" in dense.stdout, dense.stderr[-2000:]
    refused = cli(*common, "--lm-head-quantization", "fp8")
    assert refused.returncode == 2 and "lm_head_quantization='fp8'" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr[-2000:]


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def test_a_recorded_question_is_transcribed_answered_cited_and_spoken_into_a_wav(tmp_path, whisper_tiny_path):
    from speech.asr.backend import FasterWhisperBackend
    from speech.audio import read_wav, resample
    from speech.config import ASRConfig, TTSConfig
    from speech.tts import load_tts

    question = "How do I apply for annual leave?"
    speech = load_tts(TTSConfig(backend="hibari", seed=0)).synthesize(question).pcm
    stereo = np.repeat(resample(speech, 24000, 44100)[:, None], 2, axis=1)  # 44.1 kHz stereo, like a recorder's
    with wave.open(str(tmp_path / "question.wav"), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(44100)
        w.writeframes((stereo * 32767).astype("<i2").tobytes())

    r = cli("--audio", str(tmp_path / "question.wav"), "--voice", str(tmp_path / "answer.wav"), "--max-tokens", "32",
            "--max-model-len", "2048", "--timings")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert words(lines[0]) == words("> " + question)  # the transcript, printed first
    assert "[handbook en: retrieval mode" in r.stderr  # 2048 tokens cannot hold the handbook whole
    assert lines[-1].startswith("Source: 01-annual-leave.md — ")
    answer = "\n".join(lines[1:-1])
    assert len(answer.strip()) > 10

    audio, rate = read_wav(tmp_path / "answer.wav")
    assert rate == 24000 and len(audio) > rate  # over a second of speech
    heard = FasterWhisperBackend(ASRConfig(model_path=whisper_tiny_path, language="en")).transcribe(resample(audio, rate, 16000))
    spoken = {w for w in words(answer) if len(w) > 3}
    assert len(spoken & words(heard.text)) >= 0.6 * len(spoken), (answer, heard.text)


def test_unusable_audio_files_are_one_line_errors_with_exit_code_2(tmp_path):
    (tmp_path / "notes.wav").write_text("not audio", encoding="utf-8")
    with wave.open(str(tmp_path / "empty.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    with wave.open(str(tmp_path / "silence.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(2 * 16000))
    for name, message in [
        ("notes.wav", "not a readable WAV file"), ("empty.wav", "no samples"), ("missing.wav", "no such file"),
        ("silence.wav", "no speech recognised"),
    ]:
        r = cli("--audio", str(tmp_path / name))
        assert r.returncode == 2, r.stderr
        *progress, error = r.stderr.strip().splitlines()  # silence is only found out by transcribing it
        assert progress == ([] if name != "silence.wav" else ["Transcribing the question..."])
        assert error.startswith("error: --audio") and message in error and "Traceback" not in r.stderr


def speakers_available() -> bool:
    try:
        import sounddevice
    except (ImportError, OSError):  # no package, or no PortAudio library
        return False
    try:
        sounddevice.check_output_settings(samplerate=24000, channels=1)
    except (sounddevice.PortAudioError, ValueError):  # no output device
        return False
    return True


@pytest.mark.skipif(speakers_available(), reason="this machine has speakers")
def test_voice_without_speakers_says_to_write_a_file_instead(tmp_path):
    r = cli("-q", "hi", "--docs", str(small_docs(tmp_path)), "--voice")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--voice answer.wav" in r.stderr and "Traceback" not in r.stderr


async def test_voice_speaks_english_and_chinese_pieces_and_appends_every_answer_to_the_wav(tmp_path):
    from assistant.cli import OUTPUT_RATE, Voice
    from speech.audio import read_wav

    voice = Voice(tmp_path / "answers.wav")
    try:
        for delta in ["Submit the Leave Request ", "form in PeopleHub."]:
            voice.push(delta)
        await voice.finish()
        english, rate = read_wav(tmp_path / "answers.wav")
        for delta in ["年假须", "提前十个工作日申请。"]:
            voice.push(delta)
        await voice.finish()
        both, _ = read_wav(tmp_path / "answers.wav")
    finally:
        voice.close()
    assert rate == OUTPUT_RATE and len(english) > rate  # hibari: over a second of speech
    assert len(both) > len(english) + rate and np.abs(both[len(english) :]).max() > 0.05  # espeak-ng's Mandarin, appended


def test_a_one_shot_question_about_a_picture_reads_it_and_answers_from_both_with_timings(tmp_path):
    from assistant.eval_images import PICTURES, render

    picture = tmp_path / "locked.png"
    picture.write_bytes(render(next(p for p in PICTURES if p.name == "account-locked")))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "accounts.md").write_text("# Locked out\nAfter 5 failed sign-in attempts your account is locked for 15 minutes.\n")
    r = cli("--image", str(picture), "-q", "How long does this lock last?", "--docs", str(docs), "--max-tokens", "12", "--timings")
    assert r.returncode == 0, r.stderr
    assert "[image locked.png: 4 lines read in" in r.stderr and "| Your account has been locked" in r.stderr
    prompt = int(re.search(r"prompt (\d+) tokens", r.stderr).group(1))
    assert prompt > 60  # the picture's four lines went with the seven-word question
    # A one-shot question (-q): the mode in use at start, the answer streamed with its timings and
    # the section it is attributed to.
    assert "[handbook any: whole-context mode · 1 documents" in r.stderr
    assert "ttft" in r.stderr and "tok/s" in r.stderr and "cached" in r.stderr
    assert len(r.stdout.strip()) > 5 and "Source: accounts.md" in r.stdout


@pytest.mark.parametrize("content, message", [
    (b"GIF89a not really", "--image {path}: this is not an image"),
    (None, "--image {path}: no such file"),
])  # fmt: skip
def test_a_bad_picture_is_a_one_line_error_with_exit_code_2(tmp_path, content, message):
    path = tmp_path / "receipt.png"
    if content is not None:
        path.write_bytes(content)
    r = cli("--image", str(path), "-q", "Can I claim this?", "--docs", str(small_docs(tmp_path)))
    assert r.returncode == 2 and r.stderr.startswith("error: " + message.format(path=path)), r.stderr
    assert "Loading the model" not in r.stderr  # refused before the model is loaded
