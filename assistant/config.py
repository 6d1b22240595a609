"""The assistant's configuration in one typed place (documents, prompt, generation, engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HANDBOOK_DIR = Path(__file__).resolve().parent / "handbook"

SYSTEM_PROMPT = (
    "You are the employee handbook assistant of the company. Answer the employee's question "
    "using only the handbook below. Be brief: two or three sentences, with the concrete numbers, "
    "form names and steps from the handbook. If the handbook does not say, say so."
)
SYSTEM_PROMPT_ZH = (
    "你是公司的员工手册助手。只根据下面的员工手册回答员工的问题。回答要简短：两三句话，"
    "给出手册中的具体数字、表格名称和步骤。如果手册没有写，就直接说明。"
)


@dataclass
class EngineOptions:
    """The subset of engine settings the assistant exposes (see engine.EngineConfig)."""

    model: Path | None = None  # None: the embedded default (SmolLM2-135M-Instruct GGUF)
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "auto"
    """auto: int4 (the GGUF's own 4-bit blocks, bf16 activations) for a GGUF on the CPU, where it
    roughly halves decode and prefill time; none elsewhere. Or none / int4 explicitly."""
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None  # None: the model's own context length


@dataclass
class AssistantConfig:
    docs_dir: Path = HANDBOOK_DIR
    language: str = "auto"  # auto | en | zh: which handbook and system prompt to use
    max_tokens: int = 160
    temperature: float = 0.0
    engine: EngineOptions = field(default_factory=EngineOptions)
    conversation_tokens: int = 1024  # context kept for question + history; documents above it switch to retrieval
    auto_reload: bool = True  # before each answer, reload the documents if their files changed

    def validate(self) -> None:
        if self.language not in ("auto", "en", "zh"):
            raise ValueError(f"language must be auto, en or zh, got {self.language!r}")
        if self.max_tokens < 1 or self.conversation_tokens < 1:
            raise ValueError(f"max_tokens and conversation_tokens must be >= 1, got {self.max_tokens}, {self.conversation_tokens}")
        if not self.docs_dir.is_dir():
            raise FileNotFoundError(f"documents folder not found: {self.docs_dir}")
        if self.engine.model is not None and not self.engine.model.exists():
            raise FileNotFoundError(f"model not found: {self.engine.model}")


@dataclass
class VoiceConfig:
    """The voice pipeline: hearing (VAD + Whisper), speaking (TTS), turn-taking and audio out.

    asr_model: a CTranslate2 Whisper directory (None: the embedded Whisper base).
    start_ms / hangover_ms: voiced audio that starts an utterance, silence that ends it.
    max_utterance_s: longer speech is cut there and transcribed as a turn (None: no limit).
    partial_interval_s: re-decode the growing utterance this often for partial transcripts (None: off).
    output_lead_ms: answer audio is sent at real-time pace, at most this far ahead of playback,
    so a barge-in has little audio on the wire to take back.
    early_prefill: on each partial transcript, prefill the prompt so far (a max_tokens=1 request)
    so the final's prompt finds it in the prefix cache.
    endpointing: "fixed" (the turn ends after ``hangover_ms`` of silence) or "speculative" (after
    ``speculative_pause_ms`` of silence the utterance so far is transcribed and answered at once, its
    audio held; the answer is released when the turn is confirmed, by the hangover or sooner by the
    turn-completion rule (speech/turn_completion.py), and dropped unsent if the user goes on).
    false_endpoint_window_ms: speech starting this soon after an answered turn's endpoint counts as
    a false endpoint on /metrics (the turn was likely not over).
    """

    asr_model: Path | None = None
    asr_language: str = "en"
    asr_threads: int = 2
    partial_interval_s: float | None = 0.5
    start_ms: int = 60
    hangover_ms: int = 500
    max_utterance_s: float | None = 30.0
    tts_backend: str = "hibari"
    tts_model: Path | None = None
    tts_voice: str | None = None
    sample_rate: int = 24000
    output_chunk_ms: int = 100
    output_lead_ms: int = 500
    early_prefill: bool = False
    endpointing: str = "fixed"
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
    assistant: AssistantConfig = field(default_factory=AssistantConfig)
    voice: VoiceConfig = field(default_factory=VoiceConfig)

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of range (the speech configs check theirs)."""
        for name in ("max_sessions", "max_message_bytes", "max_errors", "max_body_bytes", "max_sessions_per_client",
                     "max_item_chars", "max_conversation_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_events_per_s <= 0 or self.send_timeout_s <= 0:
            raise ValueError(f"max_events_per_s and send_timeout_s must be > 0, got {self.max_events_per_s}, {self.send_timeout_s}")
        if self.voice.output_chunk_ms < 10 or self.voice.output_lead_ms < 0:
            raise ValueError("output_chunk_ms must be >= 10 and output_lead_ms >= 0")
        if self.voice.endpointing not in ("fixed", "speculative") or self.voice.speculative_pause_ms < 1:
            raise ValueError(f"endpointing must be fixed or speculative and speculative_pause_ms >= 1, got "
                             f"{self.voice.endpointing!r}, {self.voice.speculative_pause_ms}")  # fmt: skip
        if self.voice.max_utterance_s is not None and self.voice.max_utterance_s * 1000 <= self.voice.start_ms:
            raise ValueError(f"max_utterance_s must be longer than start_ms or None (off), got {self.voice.max_utterance_s}")
        self.assistant.validate()
