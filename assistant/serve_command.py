"""``python -m assistant serve``: the assistant's server (Realtime WebSocket, OpenAI HTTP, metrics).

    python -m assistant serve [--host 127.0.0.1] [--port 8000] [--docs DIR] [--model PATH] [--asr base|tiny|DIR]
                              [--early-prefill] [--coscheduler on|off] [--max-sessions 16] [--device cuda] [--tts-workers N] ...

With ``--load-format dummy --model engine/configs/llama-3.1-8b.json`` the engine holds random weights of
the Llama-3.1-8B shape (tokenized by the embedded SmolLM2's tokenizer), so the whole voice server can be
timed at that size: the documents prefix and every prompt are real, the answers are noise.

The default host is 127.0.0.1. Listening beyond loopback (e.g. ``--host 0.0.0.0``) needs an API key,
``--api-key KEY`` or ``$ASSISTANT_API_KEY``: clients then send ``Authorization: Bearer KEY`` on HTTP
and on the Realtime WebSocket (the official ``openai`` SDK does); ``/health`` stays open.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from assistant.config import (ENDPOINTING, HANDBOOK_DIR, AssistantConfig, EngineOptions, RefusalConfig, ServerConfig, VoiceConfig,
                              add_engine_arguments)
from engine.serving.auth import MissingAPIKey, resolve_api_key

API_KEY_ENV = "ASSISTANT_API_KEY"

if TYPE_CHECKING:
    from assistant.server import AssistantServer


def asr_model(value: str) -> Path:
    """``base`` / ``tiny`` (the embedded Whisper base / tiny.en) or a CTranslate2 Whisper directory."""
    if value in ("base", "tiny"):
        from assistant.models import resolve

        return resolve("asr" if value == "base" else "asr-tiny")
    return Path(value)


def parse_config(argv: list[str] | None = None) -> tuple[ServerConfig, str, bool]:
    """(server config, uvicorn log level, warm up?) from the command line."""
    p = argparse.ArgumentParser(prog="python -m assistant", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the Realtime WebSocket API, the OpenAI HTTP API, /health and /metrics")
    s.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1; any other host requires an API key")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--docs", type=Path, default=HANDBOOK_DIR, help="documents folder (default: the bundled handbook)")
    s.add_argument("--model", type=Path, help="HF model directory or llama/qwen2 .gguf (default: the embedded LLM, Qwen2.5-Coder-1.5B, or the role in $ASSISTANT_LLM, e.g. llm-qwen-0.5b)")
    s.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights of the shape in --model (a config.json, e.g. engine/configs/llama-3.1-8b.json), for timing")
    s.add_argument("--tokenizer", type=Path, help="tokenizer of another model (default: the model's; dummy weights: the embedded SmolLM2's)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU the engine plans its weights, KV cache and graphs in (default 0.9)")
    s.add_argument("--max-num-seqs", type=int, default=EngineOptions.max_num_seqs,
                   help=f"answers the engine decodes at once; more wait (default {EngineOptions.max_num_seqs})")
    s.add_argument("--graph-start-chunk", type=int, default=EngineOptions.graph_start_chunk, metavar="TOKENS",
                   help="CUDA: at start-up, capture a graph for every (answers decoding, question length) bucket with questions "
                        f"of up to this many uncached tokens; 0: none (default {EngineOptions.graph_start_chunk})")
    s.add_argument("--served-model-name", help="the model name clients see (default: the model file's stem)")
    s.add_argument("--lang", choices=("auto", "en", "zh"), default="auto", help="handbook language (default: from the question)")
    s.add_argument("--max-tokens", type=int, default=160, help="longest answer in tokens (default 160)")
    s.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    add_engine_arguments(s)
    s.add_argument("--asr", type=asr_model, default=None, metavar="base|tiny|DIR", help="Whisper model (default: base)")
    s.add_argument("--asr-language", default="en", help="speech language: en (default), zh, auto, ...")
    s.add_argument("--asr-device", choices=("auto", "cpu", "cuda"), default="auto", help="Whisper's device (auto: cuda when there is a GPU)")
    s.add_argument("--asr-backend", choices=("auto", "faster-whisper", "torch"), default="auto",
                   help="auto (default): the PyTorch Whisper on cuda, faster-whisper on the CPU")
    s.add_argument("--asr-load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: a large-v3-turbo-shaped Whisper with random weights, for timing")
    s.add_argument("--asr-graph-steps", type=int, default=8,
                   help="the PyTorch Whisper on a GPU: decoder steps one CUDA graph replay runs (default 8; 1: one a token)")
    s.add_argument("--asr-front-end-processes", type=int, default=None, metavar="N",
                   help="worker processes for the callers' resampling and VAD (default: a quarter of the cores, "
                        "at most 8, when Whisper runs on a GPU; 0: in the server's process)")
    s.add_argument("--tts-processes", action=argparse.BooleanOptionalAction, default=None,
                   help="each TTS voice instance in a worker process of its own (default: when Whisper runs on a GPU)")
    s.add_argument("--asr-encoder-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the PyTorch Whisper on a GPU: replay the encoder from CUDA graphs (default on)")
    s.add_argument("--hangover-ms", type=int, default=500, help="silence that ends a turn (default 500)")
    s.add_argument("--endpointing", choices=ENDPOINTING, default=VoiceConfig.endpointing,
                   help="fixed: a turn ends after --hangover-ms of silence; speculative: answer at a short pause, hold the "
                        "audio until the turn is confirmed (hangover, or a transcript that reads complete); auto (default): "
                        "speculative when the LLM runs on the CPU, where ASR + prefill take about a second and start at the "
                        "pause instead of after the hangover (1.5B, 2 cores, 1 caller: end of speech to first audio p50 "
                        "2,783 ms against 3,003 fixed, the same false endpoints), fixed on a GPU, where a turn is answered "
                        "within ~150 ms of the endpoint and discarded speculative answers would cost batch capacity")
    s.add_argument("--speculative-pause-ms", type=int, default=200, help="silence that starts a speculative answer (default 200)")
    s.add_argument("--max-utterance-s", type=float, default=30.0,
                   help="longer continuous speech is cut there and answered as a turn (default 30; 0: no limit)")
    s.add_argument("--tts-backend", choices=("hibari", "espeak", "coqui"), default="hibari", help="voice of the answers (default: the bundled hibari)")
    s.add_argument("--tts-voice", help="the backend's voice (espeak: e.g. en-us, cmn)")
    s.add_argument("--tts-model", type=Path, help="coqui: a checkpoint directory (model.pth + config.json)")
    s.add_argument("--tts-workers", type=int, help="voice instances synthesizing side by side, a thread each "
                                                  "(default: half the cores, 1 to 8; coqui: 1)")
    s.add_argument("--partial-interval", type=float, metavar="S",
                   help="seconds between partial transcripts; 0: off (default: 0.5 when Whisper runs on a GPU or with "
                        "--early-prefill, off on the CPU, where a partial decode delays the final)")
    s.add_argument("--early-prefill", action="store_true", help="prefill the prompt on partial transcripts")
    s.add_argument("--coscheduler", choices=("on", "off"), default="on",
                   help="on (default): ASR finals, then the turn's prefill, then its first audio go first, partials and "
                        "early prefill only with spare capacity; off: each model on its own, first come first served")
    s.add_argument("--output-lead-ms", type=int, default=500, help="answer audio sent ahead of real time (default 500)")
    s.add_argument("--max-sessions", type=int, default=16, help="open Realtime sessions at most (then close 1013)")
    s.add_argument("--max-message-bytes", type=int, default=1 << 20, help="largest client event (default 1 MiB)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest HTTP request body (default 1 MiB; larger: 413)")
    s.add_argument("--max-sessions-per-client", type=int, default=8, help="open Realtime sessions per client address (default 8; then close 1013)")
    s.add_argument("--max-events-per-s", type=float, default=200.0, help="client events per second per session (default 200; then rate_limited)")
    s.add_argument("--send-timeout", type=float, default=10.0, help="seconds a send may wait on a client that does not read (default 10; then close 1008)")
    s.add_argument("--max-item-chars", type=int, default=32_768, help="text of one conversation item (default 32768; then item_too_large)")
    s.add_argument("--max-conversation-chars", type=int, default=131_072, help="text a session's conversation keeps (default 131072)")
    s.add_argument("--no-refusal-gate", dest="refusal_gate", action="store_false",
                   help="let the model answer every question, also those the refusal gate judges the handbook does not "
                        "answer (e.g. timing runs whose random-weight Whisper transcribes noise)")
    s.add_argument("--switch-interval-ms", type=float, default=1.0,
                   help="how long a thread may keep the GIL while another waits (sys.setswitchinterval; default 1; "
                        "Python's own is 5): lower lets the event loop and the GPU threads in sooner under load")
    s.add_argument("--no-warm-up", dest="warm_up", action="store_false", help="skip computing the documents prefix at start")
    s.add_argument("--warm-documents", action="store_true",
                   help="at warm-up, also compute each document's part of a question's prompt, so a first question about "
                        "any document prefills only its own words (fast on a GPU; minutes for a 1.5B model on a small CPU)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--api-key", help=f"clients must send Authorization: Bearer KEY (default ${API_KEY_ENV}); "
                                     "required unless --host is 127.0.0.1, localhost or ::1")  # fmt: skip
    a = p.parse_args(argv)
    try:
        api_key = resolve_api_key(a.host, a.api_key, API_KEY_ENV)
    except MissingAPIKey as e:
        s.error(str(e))
    assistant = AssistantConfig(docs_dir=a.docs, language=a.lang, max_tokens=a.max_tokens, warm_documents=a.warm_documents,
                                refusal=RefusalConfig(enabled=a.refusal_gate),
                                engine=EngineOptions(model=a.model, load_format=a.load_format, tokenizer=a.tokenizer, device=a.device,
                                                     quantization=a.quantization, lm_head_quantization=a.lm_head_quantization,
                                                     kv_cache_dtype=a.kv_cache_dtype,
                                                     speculative=a.speculative_decoding, draft_model=a.draft_model,
                                                     gpu_memory_utilization=a.gpu_memory_utilization,
                                                     max_num_seqs=a.max_num_seqs, graph_start_chunk=a.graph_start_chunk))  # fmt: skip
    voice = VoiceConfig(asr_model=a.asr, asr_language=a.asr_language, asr_device=a.asr_device, asr_backend=a.asr_backend,
                        asr_load_format=a.asr_load_format, asr_graph_steps=a.asr_graph_steps,
                        asr_encoder_graphs=a.asr_encoder_graphs, front_end_processes=a.asr_front_end_processes,
                        tts_processes=a.tts_processes, hangover_ms=a.hangover_ms, max_utterance_s=a.max_utterance_s or None,
                        partial_interval_s=a.partial_interval, early_prefill=a.early_prefill,
                        coscheduler=a.coscheduler == "on", endpointing=a.endpointing, speculative_pause_ms=a.speculative_pause_ms,
                        output_lead_ms=a.output_lead_ms, tts_backend=a.tts_backend, tts_model=a.tts_model,
                        tts_voice=a.tts_voice, tts_workers=a.tts_workers)  # fmt: skip
    config = ServerConfig(host=a.host, port=a.port, model_name=a.served_model_name, max_sessions=a.max_sessions,
                          max_message_bytes=a.max_message_bytes, max_body_bytes=a.max_body_bytes, api_key=api_key,
                          max_sessions_per_client=a.max_sessions_per_client, max_events_per_s=a.max_events_per_s,
                          send_timeout_s=a.send_timeout, max_item_chars=a.max_item_chars,
                          max_conversation_chars=a.max_conversation_chars, switch_interval_ms=a.switch_interval_ms,
                          assistant=assistant, voice=voice)  # fmt: skip
    return config, a.log_level, a.warm_up


def load_server(config: ServerConfig, warm_up: bool) -> "AssistantServer":
    """The server with its models loaded (and warmed up), for command-line entry points: a bad
    setting or path exits with code 2 and a missing model package with 1, each with one line."""
    from assistant.docs import DocumentError
    from assistant.models import ModelNotAvailable
    from assistant.server import AssistantServer
    from engine import ConfigError
    from speech.config import ConfigError as SpeechConfigError

    print("Loading the model, the handbook and the speech models...", file=sys.stderr, flush=True)
    try:
        server = AssistantServer(config)
    except (DocumentError, FileNotFoundError, ConfigError, SpeechConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except ModelNotAvailable as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if warm_up:
        documents = ", each document's part of a question" if config.assistant.warm_documents else ""
        print(f"Computing the documents prefix{documents} and warming up the speech models...", file=sys.stderr, flush=True)
        try:
            server.warm_up()
        except BaseException:
            server.close()
            raise
    return server


def apply_switch_interval(config: ServerConfig) -> None:
    """Set the process's GIL switch interval (``ServerConfig.switch_interval_ms``) for serving."""
    sys.setswitchinterval(config.switch_interval_ms / 1000)


__all__ = ["apply_switch_interval", "asr_model", "load_server", "parse_config"]
