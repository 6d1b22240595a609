"""The PyTorch Whisper backend: it reads the CTranslate2 weights and transcribes like faster-whisper.

Run on the CPU in float32, against faster-whisper in float32 (greedy, no timestamps): the
transcripts are equal word for word, in a batch as one by one, and streaming sessions share it
through the worker's batches. The CUDA graph path cannot run
here; it replays the same step function that runs eagerly in these tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from speech.asr.backend import Decoded, FasterWhisperBackend
from speech.asr.factory import backend_name, load_backend
from speech.asr.ct2_weights import CT2FormatError, read_ct2_model, write_ct2_model
from speech.asr.greedy_decode import GreedyDecoder
from speech.asr.log_mel import LogMel, mel_filters
from speech.asr.torch_backend import SpecialTokens, TorchWhisperBackend
from speech.asr.whisper_model import TURBO_DIMS, parameter_count
from speech.asr.worker import ASRJob, ASRWorker
from speech.audio import resample
from speech.config import ASRConfig, ConfigError
from tests.speech.test_asr_streaming import assert_stable_prefixes, speak_into

TINY_DUMMY = replace(TURBO_DIMS, n_audio_state=64, n_audio_head=2, n_audio_layer=2, n_text_state=64,
                     n_text_head=2, n_text_layer=2)  # fmt: skip


def audio16k(clip) -> np.ndarray:
    return resample(clip.audio, clip.sample_rate, 16000)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """PyTorch's CPU threads spin at every op; on a shared 2-core machine one thread is far faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def torch_tiny(tiny_config: ASRConfig) -> TorchWhisperBackend:
    return TorchWhisperBackend(replace(tiny_config, backend="torch", device="cpu", max_batch=8))


@pytest.fixture(scope="module")
def torch_base(base_config: ASRConfig) -> TorchWhisperBackend:
    return TorchWhisperBackend(replace(base_config, backend="torch", device="cpu", max_batch=4))


@pytest.fixture(scope="module")
def float32_base(base_config: ASRConfig) -> FasterWhisperBackend:
    return FasterWhisperBackend(replace(base_config, compute_type="float32", device="cpu", cpu_threads=1))


def test_ct2_reader_round_trip(tmp_path: Path, whisper_tiny_path: Path) -> None:
    rng = np.random.default_rng(0)
    variables = {
        "a/weight": rng.standard_normal((3, 4)).astype(np.float16),
        "a/bias": rng.standard_normal(3).astype(np.float32),
        "heads": np.array(6, np.int16),
        "flag": np.array(1, np.int8),
        "ids": np.arange(5, dtype=np.int32),
        "q/weight": np.array([[127, -64], [10, 20]], np.int8),
        "q/weight_scale": np.array([127.0, 10.0], np.float32),
    }
    path = tmp_path / "model.bin"
    write_ct2_model(path, "WhisperSpec", 3, variables, {"tied/weight": "a/weight", "tied_q/weight": "q/weight"})
    model = read_ct2_model(tmp_path)
    assert (model.spec, model.revision, model.binary_version) == ("WhisperSpec", 3, 6)
    for name in ("a/weight", "a/bias", "ids"):
        assert model.variables[name].dtype == variables[name].dtype
        np.testing.assert_array_equal(model.variables[name], variables[name])
    np.testing.assert_array_equal(model.variables["tied/weight"], variables["a/weight"])
    assert model.scalar("heads") == 6 and model.scalar("flag") == 1
    np.testing.assert_allclose(model.variables["q/weight"], [[1.0, -64 / 127], [1.0, 2.0]])  # int8 / scale
    assert model.variables["tied_q/weight"] is model.variables["q/weight"]
    assert "q/weight_scale" not in model.variables
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(CT2FormatError, match="truncated"):
        read_ct2_model(path)

    tiny = read_ct2_model(whisper_tiny_path)  # the embedded model: float16, 4 + 4 layers of 6 heads
    assert tiny.spec == "WhisperSpec" and tiny.scalar("decoder/num_heads") == 6
    assert tiny.variables["decoder/embeddings/weight"].dtype == np.float16
    assert tiny.variables["decoder/layer_3/attention/linear_1/weight"].shape == (768, 384)  # cross k|v


def test_mel_features_equal_faster_whispers(question_clips) -> None:
    from faster_whisper.feature_extractor import FeatureExtractor

    for n_mels in (80, 128):
        np.testing.assert_allclose(mel_filters(n_mels), FeatureExtractor(feature_size=n_mels).mel_filters, atol=1e-6)
    clips = [audio16k(question_clips[0]), audio16k(question_clips[1])[:12345], np.zeros(1000, np.float32)]
    for clip, ours in zip(clips, LogMel(80, torch.device("cpu")).features(clips)):  # FFTs sum in their own order: 2e-5
        np.testing.assert_allclose(ours.numpy(), FeatureExtractor()(clip), atol=2e-5)


def test_transcripts_equal_faster_whisper_float32_in_a_batch_and_one_by_one(
    question_clips, torch_tiny, tiny_config
) -> None:
    """Tiny: three questions, silence and a 31 s clip (two windows) queued as finals in the shared
    worker, which decodes them as one batch; each transcript equals faster-whisper float32's, and
    one decoded alone equals its batched self."""
    reference = FasterWhisperBackend(replace(tiny_config, compute_type="float32", device="cpu", cpu_threads=1))
    questions = [audio16k(c) for c in question_clips[:3]]
    long = np.concatenate([questions[0], np.zeros(31 * 16000, np.float32)])[: 31 * 16000]
    long[-len(questions[1]) :] = questions[1]  # a question at each end: one in each window
    clips = questions + [np.zeros(32000, np.float32), long]
    decoded: dict[int, Decoded] = {}
    with ASRWorker(torch_tiny) as worker:
        with worker._cond:  # queue them all before the worker thread can take the first
            for session, clip in enumerate(clips):
                worker.submit(ASRJob(session, 0, True, clip, "", "en", 1.0,
                                     lambda job, result, q, d: decoded.setdefault(job.session, result)))  # fmt: skip
    assert (worker.stats.batches, worker.stats.largest_batch) == (1, len(clips))
    batch = [decoded[i] for i in range(len(clips))]
    expected = [reference.transcribe(clip, language="en") for clip in clips]
    assert [d.text for d in batch] == [d.text for d in expected]
    assert all(d.text for d in batch[:3]) and batch[3].text == ""
    assert batch[4].text.startswith(batch[0].text) and batch[4].text.endswith(batch[1].text.split()[-1])
    assert torch_tiny.transcribe(clips[2], language="en") == batch[2]


def test_base_language_auto_and_prefix_like_faster_whisper(question_clips, torch_base, float32_base) -> None:
    """Whisper base: language detection and a forced prefix, in one batch, as faster-whisper."""
    english = audio16k(question_clips[1])
    prefix = " ".join(question_clips[1].text.split()[:3])
    clips = [(english, "", "auto"), (english, prefix, "en")]
    ours = torch_base.transcribe_batch(clips)
    theirs = [float32_base.transcribe(audio, prefix, language) for audio, prefix, language in clips]
    assert [(d.text, d.language) for d in ours] == [(d.text, d.language) for d in theirs]
    assert ours[0].language == "en" and ours[1].text.startswith(prefix)


def test_dummy_turbo_decodes_exactly_the_forced_token_count() -> None:
    assert 800e6 < parameter_count(TURBO_DIMS) < 815e6  # large-v3-turbo: 809M, counted on the meta device
    config = ASRConfig(load_format="dummy", device="cpu", dummy_tokens=7, max_batch=4)
    assert backend_name(config) == "torch"
    backend = TorchWhisperBackend(config, dummy_dims=TINY_DUMMY)
    assert backend.model.dims.n_vocab == 51866 and backend.model.dims.n_mels == 128
    out = backend.transcribe_batch([(np.zeros(16000, np.float32), "", "en")] * 5)  # over max_batch: two rounds
    assert [(d.tokens, d.dummy) for d in out] == [(7, True)] * 5
    memory = backend.memory_bytes()
    assert memory["asr weights"] > 51866 * 64 * 4 and memory["asr buffers"] == backend.decoder.cache.nbytes > 0


def test_several_steps_a_replay_decode_as_one_step_a_replay(question_clips, torch_tiny) -> None:
    """The decoder run ``steps_per_graph`` steps between host checks (as its multi-step CUDA graph
    runs them): the same rows as one step at a time, though rows end mid-replay and keep stepping
    masked; the step count is rounded up to the replays it ran, never past the last position."""
    decoder = torch_tiny.decoder
    with torch.inference_mode():
        windows = torch_tiny.mel.windows([audio16k(c) for c in question_clips[:3]] + [np.zeros(32000, np.float32)])
        audio = torch_tiny.model.encode(windows.features)
    prompts = [torch_tiny._prompt("en", "", None) for _ in range(len(audio))]
    one = decoder.decode(audio, prompts)
    one_steps = decoder.steps_run
    several = GreedyDecoder(torch_tiny.model, decoder.rules, decoder.max_batch, cuda_graphs=False, steps_per_graph=5)
    assert several.decode(audio, prompts) == one
    assert one_steps <= several.steps_run < one_steps + 5
    assert any(len(r.tokens) + 3 < one_steps for r in one)  # some rows did end before the others
    with pytest.raises(ValueError, match="steps_per_graph"):
        GreedyDecoder(torch_tiny.model, decoder.rules, decoder.max_batch, steps_per_graph=0)


def test_the_encoder_pads_a_batch_to_its_bucket_without_changing_a_row() -> None:
    """EncoderGraphs: eager off the GPU; its buckets cover every batch size up to max_batch, and a
    row encoded in a zero-padded batch (as a graph replay encodes it) equals the row alone."""
    backend = TorchWhisperBackend(ASRConfig(load_format="dummy", device="cpu", dummy_tokens=2, max_batch=6),
                                  dummy_dims=TINY_DUMMY)  # fmt: skip
    encoder = backend.encoder
    assert encoder.captured == 0 and encoder.buckets == [1, 2, 4, 6] and encoder.nbytes == 0
    mel = torch.randn(3, 128, 3000)
    padded = torch.cat([mel, torch.zeros(1, 128, 3000)])
    torch.testing.assert_close(encoder.encode(padded)[:3], encoder.encode(mel), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at most 6"):
        encoder.encode(torch.zeros(7, 128, 3000))


def test_a_batch_waits_for_the_gpu_lock_a_capture_holds() -> None:
    """The lock the process's CUDA graph captures hold (the engine's, while serving): a batch
    does not start while it is held, and runs once it is released."""
    import threading

    lock = threading.Lock()
    config = ASRConfig(load_format="dummy", device="cpu", dummy_tokens=3, max_batch=2)
    backend = TorchWhisperBackend(config, dummy_dims=TINY_DUMMY, gpu_lock=lock)
    done = threading.Event()
    with lock:  # a capture under way elsewhere
        worker = threading.Thread(target=lambda: (backend.transcribe_batch([(np.zeros(16000, np.float32), "", "en")]), done.set()))
        worker.start()
        assert not done.wait(1.0)  # held back while the lock is taken
    assert done.wait(60)
    worker.join()
    assert not lock.locked()


def test_special_token_layout_matches_the_tokenizers(whisper_base_path: Path, whisper_tiny_path: Path) -> None:
    """The random-weight model takes its special ids from Whisper's layout: the same as the real ones."""
    for path, n_vocab in ((whisper_base_path, 51865), (whisper_tiny_path, 51864)):  # multilingual, English-only
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        real = SpecialTokens.from_tokenizer(tokenizer, [], n_vocab)
        assert replace(SpecialTokens.from_layout(n_vocab), languages={}) == real
        assert tokenizer.id_to_token(SpecialTokens.from_layout(n_vocab).languages["en"]) == "<|en|>"


def test_backend_choice_and_settings() -> None:
    assert backend_name(ASRConfig(device="cpu")) == "faster-whisper"
    assert backend_name(ASRConfig(device="cuda")) == "torch"
    assert backend_name(ASRConfig(device="cpu", backend="torch")) == "torch"
    assert backend_name(ASRConfig(device="cuda", backend="faster-whisper")) == "faster-whisper"
    with pytest.raises(ConfigError, match="needs the torch backend"):
        load_backend(ASRConfig(backend="faster-whisper", load_format="dummy", device="cpu"))
    for bad in ({"device": "tpu"}, {"load_format": "gguf"}, {"cuda_stream_priority": "low"},
                {"max_batch": 0}, {"dummy_tokens": 0}, {"graph_steps": 0}):  # fmt: skip
        with pytest.raises(ConfigError):
            ASRConfig(**bad)
    with pytest.raises(ConfigError, match="not a CTranslate2 Whisper directory"):
        TorchWhisperBackend(ASRConfig(backend="torch", device="cpu"))



async def test_four_sessions_stream_through_the_batched_backend(long_clips, torch_tiny, tiny_config, wer) -> None:
    """Four users speak at once (real time) through the shared worker on the torch backend: their
    partials and finals are decoded in batches, partials stay stable prefixes, finals are right."""
    config = replace(tiny_config, backend="torch", device="cpu")

    clips = long_clips[:4]
    with ASRWorker(torch_tiny, queue_size=config.queue_size) as worker:
        results = await asyncio.gather(*(speak_into(worker, config, c, 0.05 * i) for i, c in enumerate(clips)))
        stats = worker.stats
    assert wer([(c.text, text) for c, (text, _) in zip(clips, results)]) <= 0.25, results
    for text, partials in results:
        assert_stable_prefixes(partials + [text])
    assert stats.processed_finals == 4 and stats.processed_partials > 0
    assert 1 < stats.largest_batch <= torch_tiny.max_batch
