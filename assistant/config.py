"""The assistant's configuration in one typed place (documents, prompt, generation, engine)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

HANDBOOK_DIR = Path(__file__).resolve().parent / "handbook"
ENDPOINTING = ("auto", "fixed", "speculative")  # VoiceConfig.endpointing

SYSTEM_PROMPT = (
    "You are the employee handbook assistant of the company. Answer the employee's question using only "
    "the handbook below, in one or two short sentences, not a list: give the exact figure from the "
    "handbook and the form code or the contact it names. If the handbook does not answer the question, "
    "say that the handbook does not say, and name the contact from Who to Contact to ask, with their "
    "email. Never guess a number."
)
SYSTEM_PROMPT_ZH = (
    "你是公司的员工手册助手。只根据下面的员工手册回答员工的问题，用一两句话简短回答，不要列清单："
    "给出手册中的确切数字，并写出手册中的表格编号或联系人。如果手册没有回答这个问题，"
    "就说明手册中没有写，并根据“联系方式”写出应该联系谁及其邮箱。不要猜测数字。"
)


@dataclass
class EngineOptions:
    """The subset of engine settings the assistant exposes (see engine.EngineConfig)."""

    model: Path | None = None  # None: the embedded default LLM (assistant.models.resolve("llm"))
    load_format: str = "auto"
    """dummy: random weights of the shape in ``model`` (a config.json), for timing at a size whose
    weights are not here (e.g. engine/configs/llama-3.1-8b.json); the answers are noise."""
    tokenizer: Path | None = None
    """A tokenizer other than the model's (HF directory or .gguf); None: the model's own, or with
    dummy weights the embedded SmolLM2's (its 49k ids fit any Llama shape's vocabulary)."""
    device: str = "auto"
    gpu_memory_utilization: float = 0.90  # share of the GPU the engine plans with (weights, KV cache, graphs)
    dtype: str = "auto"
    quantization: str = "auto"
    """auto: int4 (the GGUF's own 4-bit blocks, bf16 activations) for a GGUF on the CPU, where it
    roughly halves decode and prefill time; none elsewhere. Or none / int4 explicitly."""
    lm_head_quantization: str = "none"
    """fp8 / int4: the output head in its own format (engine.EngineConfig.lm_head_quantization), on
    CUDA with fp8 or bf16 layers. On the 8B shape an e4m3 head made batch-1 decode 5% faster over
    FP8 layers and 7% over int4 ones on an H100, 2.7% over FP8 layers on an H200
    (docs/performance.md); on the 1.5B it cost 2-2.5 points of next-token agreement and no fact
    on the handbook eval; none (default): bf16, like the embeddings."""
    kv_cache_dtype: str = "auto"
    """fp8: the KV cache in e4m3 with a scale per token and head (engine.EngineConfig.kv_cache_dtype),
    ~1.94x the tokens in the same memory; auto: the model's dtype."""
    speculative: str = "auto"
    """auto: n-gram speculative decoding (engine.EngineConfig.speculative) on the CPU, where an
    answer that quotes the handbook decodes 1.67x faster at batch 1 (Qwen2.5-Coder-1.5B int4,
    2-core CPU, docs/performance.md), and off on CUDA: there the engine decides n-gram drafts on
    the device inside its CUDA graphs (1.47x batch-1 decode on an H200 with the 1.5B, k=4,
    n-grams 1..8, 2026-12-07), but the voice stack on one GPU has not been measured with them (row
    and speculation graphs add captures and memory beside Whisper and the TTS). Or off / ngram / draft explicitly
    (draft: ``draft_model`` proposes; on the 2-core CPU its steps cost more than they save, so
    there it stays off in effect)."""
    draft_model: Path | None = None
    """With speculative="draft": the draft model (same tokenizer as ``model``); None: the embedded
    Qwen2.5-Coder-0.5B (assistant.models.resolve("llm-qwen-0.5b"))."""
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    captures_while_serving: int = 0
    """Mixed-step CUDA graphs (decodes plus a prefill chunk) the engine may capture while serving
    (engine.EngineConfig.mixed_cuda_graph_max_graphs). Each stalls every turn in flight (on the
    H200 at 64 callers one took 3.3 s: a 2.4 s warm-up and a 0.9 s capture), so none by default:
    the start-up captures cover a question after the cached documents, other mixed steps run the
    piecewise graphs."""
    graph_start_chunk: int = 128
    """On CUDA, capture at start-up a CUDA graph for every (answers decoding, question tokens) bucket
    with questions of up to this many uncached tokens (engine.EngineConfig.mixed_cuda_graph_start_chunk;
    with 128 answers at once, 103 graphs in all, 768 MiB more graph memory on the H200): a question arriving while other answers decode then runs as one graph.
    Without it such a step's attention runs eagerly, each kernel launch waiting for the GIL behind
    the speech workers' threads (H200, 64 callers: 172 ms a step instead of ~20). The engine then
    gives a step with decodes one question chunk of at most this size, so that it fits a graph.
    0: only a question while nothing else decodes. Ignored on the CPU."""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options of :class:`EngineOptions`' weight, cache and speculation choices
    (--quantization, --lm-head-quantization, --kv-cache-dtype, --speculative-decoding, --draft-model),
    one wording for the text CLI and the server."""
    parser.add_argument(
        "--quantization", choices=("auto", "none", "int4", "fp8"), default="auto",
        help="int4: the GGUF's own 4-bit weights with bf16 activations (CPU); fp8: e4m3 layer weights (a GPU with FP8 "
             "tensor cores; the CPU emulates them, slowly); auto (default): int4 for a GGUF on the CPU")
    parser.add_argument(
        "--lm-head-quantization", choices=("none", "fp8", "int4"), default="none",
        help="fp8 / int4: the output head in its own format (a GPU; the CPU's int4 path already runs the GGUF's head "
             "in 4 bits and refuses it); fp8 made batch-1 decode of the 8B shape 2.7-7%% faster (H200, H100) for 2-2.5 points of "
             "next-token agreement; none (default): bf16")
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
        help="fp8: K and V cached in e4m3 with a scale per token and head, ~1.94x the tokens in the same memory (a compute "
             "capability 8.9+ GPU); auto (default): the model's dtype")
    parser.add_argument(
        "--speculative-decoding", choices=("auto", "off", "ngram", "draft"), default="auto",
        help="ngram: speculative decoding by n-gram prompt lookup (the same answers, fewer steps); draft: by a "
             "draft model's greedy tokens (--draft-model); auto (default): ngram on the CPU, off on CUDA")
    parser.add_argument(
        "--draft-model", type=Path,
        help="with --speculative-decoding draft: the draft model, same tokenizer as the model (default: the embedded "
             "Qwen2.5-Coder-0.5B)")


@dataclass
class RefusalConfig:
    """The refusal gate (assistant/refusal.py): questions the handbook does not answer get "the
    handbook does not say" and the contact to ask, without asking the model.

    uncovered_share: a question with words the handbook has nowhere is refused when the words
    that its best-matching document lacks carry at least this share of its content weight (IDF);
    1.0: only when that document has none of its words.
    """

    enabled: bool = True
    uncovered_share: float = 0.55

    def validate(self) -> None:
        if not 0.0 < self.uncovered_share <= 1.0:
            raise ValueError(f"refusal uncovered_share must be in (0, 1], got {self.uncovered_share}")


@dataclass
class AssistantConfig:
    docs_dir: Path = HANDBOOK_DIR
    language: str = "auto"  # auto | en | zh: which handbook and system prompt to use
    max_tokens: int = 160
    temperature: float = 0.0
    engine: EngineOptions = field(default_factory=EngineOptions)
    conversation_tokens: int = 1024  # context kept for question + history; documents above it switch to retrieval
    auto_reload: bool = True  # before each answer, reload the documents if their files changed
    # at warm-up, compute each document's part of a question's prompt (Answerer.warm_documents): a first
    # question about any document then prefills only its own words; minutes for a 1.5B model on a small CPU
    warm_documents: bool = False
    refusal: RefusalConfig = field(default_factory=RefusalConfig)

    def validate(self) -> None:
        if self.language not in ("auto", "en", "zh"):
            raise ValueError(f"language must be auto, en or zh, got {self.language!r}")
        if self.max_tokens < 1 or self.conversation_tokens < 1:
            raise ValueError(f"max_tokens and conversation_tokens must be >= 1, got {self.max_tokens}, {self.conversation_tokens}")
        if not self.docs_dir.is_dir():
            raise FileNotFoundError(f"documents folder not found: {self.docs_dir}")
        if self.engine.model is not None and not self.engine.model.exists():
            raise FileNotFoundError(f"model not found: {self.engine.model}")
        if self.engine.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.engine.load_format!r}")
        if self.engine.load_format == "dummy" and self.engine.model is None:
            raise ValueError("load_format dummy needs a model config.json (e.g. engine/configs/llama-3.1-8b.json)")
        if self.engine.tokenizer is not None and not self.engine.tokenizer.exists():
            raise FileNotFoundError(f"tokenizer not found: {self.engine.tokenizer}")
        if self.engine.draft_model is not None and self.engine.speculative != "draft":
            raise ValueError(f"a draft model ({self.engine.draft_model}) is used only with speculative decoding 'draft' "
                             f"(--speculative-decoding draft), not {self.engine.speculative!r}")
        if self.engine.draft_model is not None and not self.engine.draft_model.exists():
            raise FileNotFoundError(f"draft model not found: {self.engine.draft_model}")
        self.refusal.validate()


@dataclass
class VoiceConfig:
    """The voice pipeline: hearing (VAD + Whisper), speaking (TTS), turn-taking and audio out.

    asr_model: a CTranslate2 Whisper directory (None: the embedded Whisper base).
    asr_device / asr_backend / asr_load_format: ``speech.config.ASRConfig``'s device, backend and
    load_format ("auto": the torch Whisper on a GPU, faster-whisper on the CPU; "dummy": the
    large-v3-turbo shape with random weights, for timing).
    asr_graph_steps / asr_encoder_graphs: ``ASRConfig.graph_steps`` and ``encoder_cuda_graphs``
    (the torch Whisper on a GPU: decoder steps a CUDA graph replay runs; the encoder from graphs).
    front_end_processes: worker processes for the callers' resampling and VAD
    (``ASRConfig.front_end_processes``; None: a quarter of the cores, at most 8, when Whisper runs
    on a GPU, where the server's GIL is the engine's and Whisper's; 0 on the CPU).
    tts_processes: each TTS voice instance in a worker process of its own (``TTSConfig.processes``;
    None: when Whisper runs on a GPU, for the same reason).
    start_ms / hangover_ms: voiced audio that starts an utterance, silence that ends it.
    max_utterance_s: longer speech is cut there and transcribed as a turn (None: no limit).
    partial_interval_s: re-decode the growing utterance this often for partial transcripts; 0: off;
    None (the default): every 0.5 s when Whisper runs on a GPU or early prefill wants them, off on the
    CPU. There a Whisper base decode takes about a second on 2 cores, as long as the VAD hangover: the
    final waited behind a partial still running and the LLM shared the cores with it, and no partial
    reached the caller before its final (1.5B voice bench, 1 caller: 3.6-3.9 s end of speech to first
    audio without partials, 4.6-5.4 s with them).
    output_lead_ms: answer audio is sent at real-time pace, at most this far ahead of playback,
    so a barge-in has little audio on the wire to take back.
    tts_workers: voice instances synthesizing side by side, a thread each (None: the speech
    package's default, half the cores up to 8).
    early_prefill: on each partial transcript, prefill the prompt so far (a max_tokens=1 request)
    so the final's prompt finds it in the prefix cache.
    coscheduler: order the ASR worker, the engine and the TTS worker by turn urgency
    (``assistant/coscheduler.py``); False: each on its own, first come first served.
    coscheduler_step_tokens: while a turn waits for its ASR final or first token, the engine's
    other requests share at most this many tokens a step.
    endpointing: "fixed" (the turn ends after ``hangover_ms`` of silence), "speculative" (after
    ``speculative_pause_ms`` of silence the utterance so far is transcribed and answered at once, its
    audio held; the answer is released when the turn is confirmed, by the hangover or sooner by the
    turn-completion rule (speech/turn_completion.py), and dropped unsent if the user goes on) or
    "auto" (the default): speculative when the LLM engine runs on the CPU, fixed on a GPU. "auto" is
    made concrete once, when the server loads (``assistant.voice_services.endpointing``, from the
    loaded engine's device): the sessions and their timelines only see "fixed" or "speculative".
    Why: on the 2-core CPU with the 1.5B model, the voice bench at 1 caller measured end of speech
    to first audio p50 2,783 ms speculative against 3,003 ms fixed (10 turns each, 5 with a
    mid-sentence pause, back to back on an AMX Xeon, 2026-12-03; the same false endpoints in both
    modes, 2 of 5 paused turns), and 2,405 against 2,839 ms in a 3-turn pair: the speculative answer
    starts ASR and prefill at the 200 ms pause instead of after the 500 ms hangover, which pays
    where ASR + prefill take about a second. On a GPU fixed stays the default: its turn is answered
    within ~150 ms of the endpoint, and discarded speculative answers would cost batch capacity at
    many callers.
    false_endpoint_window_ms: speech starting this soon after an answered turn's endpoint counts as
    a false endpoint on /metrics (the turn was likely not over).
    """

    asr_model: Path | None = None
    asr_language: str = "en"
    asr_threads: int = 2
    asr_device: str = "auto"
    asr_backend: str = "auto"
    asr_load_format: str = "auto"
    asr_graph_steps: int = 8
    asr_encoder_graphs: bool = True
    front_end_processes: int | None = None
    tts_processes: bool | None = None
    partial_interval_s: float | None = None
    start_ms: int = 60
    hangover_ms: int = 500
    max_utterance_s: float | None = 30.0
    tts_backend: str = "hibari"
    tts_model: Path | None = None
    tts_voice: str | None = None
    tts_workers: int | None = None
    sample_rate: int = 24000
    output_chunk_ms: int = 100
    output_lead_ms: int = 500
    early_prefill: bool = False
    coscheduler: bool = True
    coscheduler_step_tokens: int = 256
    endpointing: str = "auto"
    speculative_pause_ms: int = 200
    false_endpoint_window_ms: int = 1500


@dataclass
class ServerConfig:
    """``python -m assistant serve``: where to listen, the session limits, and the parts it runs."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # the name clients send as `model` (default: the model file's stem)
    max_sessions: int = 16
    max_message_bytes: int = 1 << 20  # a larger client event gets an `error`; the session lives on
    max_errors: int = 32  # this many invalid client events in a row close the socket (1008)
    api_key: str | None = None  # clients must send it (Bearer); required beyond loopback (see serve_command)
    max_body_bytes: int = 1 << 20  # a larger HTTP request body gets a 413
    max_sessions_per_client: int = 8  # open Realtime sessions per client address (then close 1013)
    max_events_per_s: float = 200.0  # client events per second per session, in bursts of up to 2 s worth
    send_timeout_s: float = 10.0  # a client that reads nothing for this long is closed (1008) and released
    max_item_chars: int = 32_768  # text of one conversation.item.create
    max_conversation_chars: int = 131_072  # text a session's conversation keeps (oldest answered turns go first)
    # permessage-deflate on the WebSockets: off. The Realtime API's traffic is base64 audio, which
    # barely compresses, and zlib runs on the event loop: on the H200 at 128 callers it was the
    # largest share of the loop's time, and late pings closed sessions.
    ws_compression: bool = False
    # How long a thread may hold the GIL while another waits for it (sys.setswitchinterval). The
    # event loop, the speech front end, the voice workers and the engine's thread share one GIL;
    # a thread waking from a wait (a GPU sync, epoll) may wait this long behind a busy one, so a
    # lower value trades some throughput for shorter waits. Python's default is 5 ms; on the H200
    # at 32 callers 1 ms halved endpoint -> first audio (p50 765 -> 369 ms, p95 1,202 -> 889).
    switch_interval_ms: float = 1.0
    assistant: AssistantConfig = field(default_factory=AssistantConfig)
    voice: VoiceConfig = field(default_factory=VoiceConfig)

    def uvicorn_options(self) -> dict[str, object]:
        """The uvicorn settings this config implies: the WebSocket frame limit and compression."""
        return {"ws_max_size": max(16 << 20, 4 * self.max_message_bytes), "ws_per_message_deflate": self.ws_compression}

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range (the speech configs check theirs)."""
        for name in ("max_sessions", "max_message_bytes", "max_errors", "max_body_bytes", "max_sessions_per_client",
                     "max_item_chars", "max_conversation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.switch_interval_ms <= 100:
            raise ValueError(f"switch_interval_ms must be in (0, 100], got {self.switch_interval_ms}")
        if self.max_events_per_s <= 0 or self.send_timeout_s <= 0:
            raise ValueError(f"max_events_per_s and send_timeout_s must be > 0, got {self.max_events_per_s}, {self.send_timeout_s}")
        if self.voice.output_chunk_ms < 10 or self.voice.output_lead_ms < 0:
            raise ValueError("output_chunk_ms must be >= 10 and output_lead_ms >= 0")
        if self.voice.coscheduler_step_tokens < 1:
            raise ValueError(f"coscheduler_step_tokens must be >= 1, got {self.voice.coscheduler_step_tokens}")
        if self.voice.endpointing not in ENDPOINTING or self.voice.speculative_pause_ms < 1:
            raise ValueError(f"endpointing must be auto, fixed or speculative and speculative_pause_ms >= 1, got "
                             f"{self.voice.endpointing!r}, {self.voice.speculative_pause_ms}")  # fmt: skip
        if self.voice.max_utterance_s is not None and self.voice.max_utterance_s * 1000 <= self.voice.start_ms:
            raise ValueError(f"max_utterance_s must be longer than start_ms or None (off), got {self.voice.max_utterance_s}")
        self.assistant.validate()
