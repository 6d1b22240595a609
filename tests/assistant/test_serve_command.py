"""``python -m assistant serve`` options reach the configs, and the voice they pick really speaks."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from assistant.config import ServerConfig
from assistant.serve_command import apply_switch_interval, parse_config
from speech.config import TTSConfig
from speech.tts.factory import load_tts


def test_tts_options_reach_the_voice_config_and_that_backend_speaks():
    config, _, _ = parse_config(["serve", "--tts-backend", "espeak", "--tts-voice", "en-us", "--port", "0"])
    voice = config.voice
    assert (voice.tts_backend, voice.tts_voice, voice.tts_model) == ("espeak", "en-us", None)
    tts = load_tts(TTSConfig(backend=voice.tts_backend, voice=voice.tts_voice))
    audio = np.concatenate([c.pcm for c in tts.stream("Annual leave is twenty days.")])
    assert audio.size > 0.5 * tts.sample_rate and np.abs(audio.astype(np.float64)).max() > 0


def test_max_utterance_length_reaches_the_voice_config():
    """30 s by default; 0 turns the cut off; a length shorter than the speech start is refused."""
    assert parse_config(["serve"])[0].voice.max_utterance_s == 30.0
    assert parse_config(["serve", "--max-utterance-s", "12.5"])[0].voice.max_utterance_s == 12.5
    config = parse_config(["serve", "--max-utterance-s", "0"])[0]
    assert config.voice.max_utterance_s is None
    config.validate()
    config.voice.max_utterance_s = 0.01
    with pytest.raises(ValueError, match="max_utterance_s must be longer than start_ms"):
        config.validate()


def test_unknown_tts_backend_is_refused_by_the_command_line(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["serve", "--tts-backend", "festival"])
    assert e.value.code == 2 and "festival" in capsys.readouterr().err


def test_bad_documents_folder_exits_2_with_one_line_for_both_entry_points(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    for module in ("assistant", "web"):
        args = [sys.executable, "-m", module, *(["serve"] if module == "assistant" else []), "--docs", str(tmp_path / "nope"), "--port", "0"]
        r = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and "not found" in errors[0], (module, r.stderr)
        assert "Traceback" not in r.stderr


def test_dummy_weights_of_a_config_shape_serve_the_bundled_handbook(tmp_path, whisper_tiny_path):
    """``--load-format dummy --model config.json``: random weights of that shape (here 2 layers), the
    embedded SmolLM2 tokenizer, the whole bundled handbook as the cached prefix; a chat is answered.
    With ``--warm-documents`` the warm-up also cached the document repeated in front of the
    question, so only the question's own words are prefilled."""
    import json

    import httpx

    from assistant.server import AssistantServer
    from engine.serving.server import BackgroundServer

    shape = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "max_position_embeddings": 16384, "tie_word_embeddings": False, "torch_dtype": "float32"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(shape))
    config, _, _ = parse_config(["serve", "--load-format", "dummy", "--model", str(tmp_path / "config.json"), "--device", "cpu",
                                 "--asr", str(whisper_tiny_path), "--lang", "en", "--max-tokens", "8", "--tts-workers", "1",
                                 "--max-num-seqs", "4", "--warm-documents"])  # fmt: skip
    assert (config.assistant.engine.load_format, config.voice.tts_workers, config.assistant.engine.max_num_seqs) == ("dummy", 1, 4)
    assert config.assistant.warm_documents
    server = AssistantServer(config)
    try:
        assert server.answerer.modes["en"] == "whole-context"  # the whole handbook is the prefix
        # endpointing auto by default, made concrete at start-up: speculative with the engine on the CPU
        assert (config.voice.endpointing, server.services.config.endpointing) == ("auto", "speculative")
        assert server.answerer.engine.core.model_config.num_hidden_layers == 2
        server.warm_up()
        with BackgroundServer(server.app) as http:
            r = httpx.post(http.url + "/v1/chat/completions", timeout=300,
                           json={"messages": [{"role": "user", "content": "How do I apply for annual leave?"}]})  # fmt: skip
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            prefix = len(server.answerer.builders["en"].prefix.token_ids)
            uncached = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
            assert usage["completion_tokens"] == 8 and prefix > 1000 and uncached < 100  # the question and the answer form
            assert usage["prompt_tokens"] - prefix > 200  # the annual-leave page was in the prompt, and cached
            assert 'assistant_memory_bytes{device="cpu",owner="llm weights"}' in httpx.get(http.url + "/metrics").text
    finally:
        server.close()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    import json

    from assistant.answerer import Answerer
    from assistant.config import AssistantConfig, EngineOptions

    shape = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 16, "max_position_embeddings": 2048}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(shape))
    with pytest.raises(ValueError, match="49152 tokens do not fit the model's vocabulary of 1000"):
        Answerer.create(AssistantConfig(engine=EngineOptions(model=tmp_path / "config.json", load_format="dummy", device="cpu")))


def test_asr_device_backend_and_load_format_reach_the_voice_config():
    """auto everywhere by default (the torch Whisper on a GPU, faster-whisper on the CPU)."""
    from speech.asr.factory import backend_name
    from speech.config import ASRConfig

    voice = parse_config(["serve"])[0].voice
    assert (voice.asr_device, voice.asr_backend, voice.asr_load_format) == ("auto", "auto", "auto")
    voice = parse_config(["serve", "--asr-device", "cuda", "--asr-load-format", "dummy"])[0].voice
    asr = ASRConfig(device=voice.asr_device, backend=voice.asr_backend, load_format=voice.asr_load_format)
    assert backend_name(asr) == "torch"
    voice = parse_config(["serve", "--asr-device", "cpu", "--asr-backend", "torch"])[0].voice
    assert (voice.asr_device, voice.asr_backend) == ("cpu", "torch")
    assert (voice.asr_graph_steps, voice.asr_encoder_graphs) == (8, True)
    voice = parse_config(["serve", "--asr-graph-steps", "1", "--no-asr-encoder-graphs"])[0].voice
    assert (voice.asr_graph_steps, voice.asr_encoder_graphs) == (1, False)
    from assistant.voice_services import front_end_processes, tts_processes

    assert voice.front_end_processes is None and front_end_processes(voice) == 0  # no GPU here: in-process
    voice = parse_config(["serve", "--asr-front-end-processes", "2", "--tts-processes"])[0].voice
    assert front_end_processes(voice) == 2 and tts_processes(voice)
    assert not tts_processes(parse_config(["serve"])[0].voice)  # no GPU here: voices in this process
    from assistant.voice_services import partial_interval

    assert partial_interval(parse_config(["serve"])[0].voice) is None  # no GPU here: no partials by default
    assert partial_interval(parse_config(["serve", "--early-prefill"])[0].voice) == 0.5  # early prefill needs them
    assert partial_interval(parse_config(["serve", "--partial-interval", "0.3"])[0].voice) == 0.3
    assert partial_interval(parse_config(["serve", "--partial-interval", "0", "--early-prefill"])[0].voice) is None
    assert partial_interval(parse_config(["serve", "--asr-device", "cuda"])[0].voice) == 0.5  # Whisper on a GPU


def test_endpointing_is_auto_by_default_speculative_for_an_engine_on_the_cpu_and_fixed_on_cuda(capsys):
    """auto, fixed and speculative are accepted (auto by default, the VoiceConfig default too);
    auto is made concrete by the engine's device; any other mode is refused, by the command line
    and by the config's check."""
    import torch

    from assistant.config import VoiceConfig
    from assistant.voice_services import endpointing

    assert parse_config(["serve"])[0].voice.endpointing == VoiceConfig().endpointing == "auto"
    for mode in ("fixed", "speculative"):
        voice = parse_config(["serve", "--endpointing", mode])[0].voice
        assert voice.endpointing == mode
        assert endpointing(voice, torch.device("cpu")) == endpointing(voice, torch.device("cuda")) == mode
    auto = VoiceConfig()
    assert (endpointing(auto, torch.device("cpu")), endpointing(auto, torch.device("cuda", 0))) == ("speculative", "fixed")
    with pytest.raises(SystemExit) as e:
        parse_config(["serve", "--endpointing", "eager"])
    assert e.value.code == 2 and "eager" in capsys.readouterr().err
    with pytest.raises(ValueError, match="endpointing must be auto, fixed or speculative"):
        ServerConfig(voice=VoiceConfig(endpointing="eager")).validate()


def test_the_gil_switch_interval_reaches_the_serving_process():
    config = parse_config(["serve", "--switch-interval-ms", "0.5"])[0]
    assert config.switch_interval_ms == 0.5 and parse_config(["serve"])[0].switch_interval_ms == 1.0
    before = sys.getswitchinterval()
    try:
        apply_switch_interval(config)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ValueError, match="switch_interval_ms"):
        ServerConfig(switch_interval_ms=0).validate()


def test_the_refusal_gate_is_on_unless_turned_off():
    assert parse_config(["serve"])[0].assistant.refusal.enabled
    assert not parse_config(["serve", "--no-refusal-gate"])[0].assistant.refusal.enabled


def test_kv_cache_dtype_reaches_the_engine_options():
    """--kv-cache-dtype fp8 (an e4m3 KV cache) is passed through to the engine; auto by default."""
    assert parse_config(["serve"])[0].assistant.engine.kv_cache_dtype == "auto"
    assert parse_config(["serve", "--kv-cache-dtype", "fp8"])[0].assistant.engine.kv_cache_dtype == "fp8"


def test_lm_head_quantization_reaches_the_engine_options():
    """--lm-head-quantization fp8 (the output head in e4m3) is passed through to the engine; none by default."""
    assert parse_config(["serve"])[0].assistant.engine.lm_head_quantization == "none"
    assert parse_config(["serve", "--lm-head-quantization", "fp8"])[0].assistant.engine.lm_head_quantization == "fp8"
