"""Engine configuration: the model's architecture and the engine's knobs, in one typed place."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """An engine or model setting is invalid; the message names the setting and what is allowed."""


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""The model families the engine runs (GGUF ``general.architecture`` / HF ``model_type``), with
their HF class names. Qwen2 is Llama with biases on q/k/v (and its own GGUF keys)."""


def hf_architecture(d: dict[str, Any]) -> str:
    """The family of a HF ``config.json`` dict: its ``model_type``, else its ``architectures``;
    a dict naming neither is a Llama (the engine's own dummy configs)."""
    model_type, classes = d.get("model_type"), d.get("architectures") or []
    if model_type in ARCHITECTURES:
        return model_type
    for arch, cls in ARCHITECTURES.items():
        if cls in classes:
            return arch
    if model_type is None and not classes:
        return "llama"
    raise ConfigError(f"model_type {model_type!r} (architectures {classes}) is not supported; "
                      f"the engine runs {', '.join(ARCHITECTURES)}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family model (HF ``config.json`` names): ``architecture`` is one
    of :data:`ARCHITECTURES`; ``attention_bias``: q/k/v carry biases (Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"
    architecture: str = "llama"
    attention_bias: bool = False

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "llama") -> ModelConfig:
        """Build from a HF ``LlamaConfig`` or ``Qwen2Config`` dict (``rope_parameters`` or ``rope_scaling``)."""
        architecture = hf_architecture(d)
        if d.get("use_sliding_window"):
            raise ConfigError("sliding-window attention (use_sliding_window) is not supported")
        if d.get("mlp_bias"):
            raise ConfigError("biases on the MLP (mlp_bias) are not supported")
        heads = d["num_attention_heads"]
        rope = d.get("rope_scaling") or d.get("rope_parameters") or None
        theta = d.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=dict(rope) if rope else None,
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            architecture=architecture,
            attention_bias=bool(d.get("attention_bias", architecture == "qwen2")),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            raw = json.load(f)
        try:
            return cls.from_hf_dict(raw, name=path.parent.name if path.name == "config.json" else path.stem)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config keyword arguments for this model (reference models): ``LlamaConfig``'s, or
        ``Qwen2Config``'s as ``architectures`` names."""
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
        if self.architecture == "llama":  # Qwen2 always has the biases (no such key)
            d["attention_bias"] = self.attention_bias
        if self.rope_scaling:
            d["rope_scaling"] = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return d

    @property
    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h + (q + 2 * kv if self.attention_bias else 0)
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * layer + h

    @property
    def num_projection_parameters(self) -> int:
        """The layers' projections' weights (q|k|v, o, gate|up, down): what FP8 or int4 quantizes,
        and what an FP8 run multiplies on FP8 tensor cores."""
        h, f = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return self.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * f)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def default_cache_dir() -> Path:
    """Where the engine keeps converted artifacts (tokenizers from GGUF files)."""
    if os.environ.get("ENGINE_CACHE_DIR"):
        return Path(os.environ["ENGINE_CACHE_DIR"])
    from platformdirs import user_cache_dir  # only needed when something is cached

    return Path(user_cache_dir("handbook-assistant")) / "engine"


ROW_COST_BY_DEVICE = {"cpu": 0.45, "cuda": 0.05}
"""``EngineConfig.speculative_row_cost`` by device type, measured. The 2-core CPU's native step is
bound by its dot products: a 5-row step took ~2.7x a 1-row one (0.43 a row), more with a long
context (each row attends over it). A GPU step of a small model is bound by reading the weights
and by launches: on an H100 (2026-12-07, Qwen2.5-Coder-1.5B, a 2,162-token prompt) verifying
steps of 3.5 rows on average took 1.79 ms on the device against 1.62 ms for one row (0.04 a row)."""


@dataclass
class EngineConfig:
    """Everything the engine needs to know; validated once by :meth:`validate`."""

    model: str
    """An HF directory (config.json + safetensors), a llama or qwen2 ``.gguf`` file, or with
    ``load_format="dummy"`` a config.json (file or directory) for random weights."""
    load_format: Literal["auto", "dummy"] = "auto"
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    seed: int = 0
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    max_model_len: int | None = None
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    """``auto``: K and V in the model's dtype; ``fp8``: in e4m3 with a float32 scale per token and KV
    head (engine/kv_cache.py), ~1.94x the tokens in the same memory. Runs on the Triton backend of a
    compute capability 8.9+ GPU, or the torch backend (the CPU without the native decode step)."""
    # Scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    enable_prefix_caching: bool = True
    # Execution
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    enable_cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024)
    """Decode graph buckets; only those up to ``max_num_seqs`` are captured."""
    row_cuda_graphs: Literal["auto", "on", "off"] = "auto"
    """Row graphs (engine/cuda_graph.py): steps whose requests bring at most
    ``num_speculative_tokens + 1`` tokens each, up to ``speculative_max_batch`` of them, replay a
    decode graph with a row per token (buckets of ``cuda_graph_batch_sizes``): a verifying step
    of speculative decoding, or a draft model's catch-up step, as one replay instead of a mixed or
    piecewise step. ``auto``: with speculative decoding (the draft engine turns them on too)."""
    # Steps with prefill chunks of at most this many tokens replay everything but attention as
    # CUDA graphs (engine/cuda_graph.py); sizes above max_num_batched_tokens are not captured.
    # Buckets are at most 25% apart: a step pads up to the next one.
    piecewise_cuda_graph_sizes: tuple[int, ...] = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768,
                                                   896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144,
                                                   7168, 8192)
    mixed_cuda_graph_max_chunk: int = 512
    """Steps of decodes plus one prefill chunk of at most this many tokens run as one CUDA graph,
    attention included, per (decode bucket, chunk bucket): the chunk is padded up to the next of
    ``piecewise_cuda_graph_sizes``. A lone chunk (a question after a cached prefix) is captured at
    start-up for every chunk bucket; other shapes the second time they are seen (a long prompt
    chunked while others decode). 0: off (such steps take the piecewise graphs, attention eager)."""
    mixed_cuda_graph_max_decodes: int = 64
    """Mixed-step graphs only for steps of at most this many decodes: a step with more is
    device-bound (the host launches it while the device is still busy), so a capture (a stall of
    the engine: see ``mixed_cuda_graph_max_graphs``) would not pay; with
    256 (every size) the throughput run captured 39 shapes and fell from 9.2k to 8.4k out tok/s."""
    mixed_cuda_graph_start_chunk: int = 0
    """At start-up, besides the lone chunks, capture every (decode bucket, chunk bucket) whose chunk
    bucket is at most this many tokens (decode buckets up to ``mixed_cuda_graph_max_decodes``):
    about 60 ms each on the H200 (warm-up and capture), so 128 with 64 decodes is ~70 graphs, ~4 s.
    For a server whose questions arrive while other answers decode and whose process has other
    Python threads (the voice assistant): there a piecewise step's eager attention waits for the
    GIL launch after launch. The scheduler then keeps every step with decodes to one prefill chunk
    of at most this many tokens (SchedulerConfig.beside_decodes_max_chunk), so that it fits a
    graph. 0: lone chunks only, and no such limit."""
    mixed_cuda_graph_max_graphs: int = 16
    """How many mixed-step shapes are captured while serving, in the engine's life (each capture stalls the
    engine: 31-74 ms on the H200, timed on their own in the chunked suite, 2026-11-30; the first
    took 0.66 s of Triton compiles until the start-up warm-up ran a mixed step); later shapes
    take the piecewise graphs. 0: none (only the lone chunks captured at start-up)."""
    batch1_gemv: bool = True
    """On CUDA, batch-1 decode steps run q|k|v, o_proj, gate|up (SwiGLU in its epilogue) and the
    lm_head as Triton GEMVs (engine/kernels/linear.py, measured faster than cuBLAS there); off:
    cuBLAS throughout (engine/kernels/gemv_policy.py)."""
    pdl: Literal["auto", "on", "off"] = "auto"
    """Programmatic dependent launch for the batch-1 decode path's Triton kernels: each may start
    while the previous one finishes (engine/kernels/_pdl_triton.py).
    ``auto``: on where supported (batch1_gemv on, a compute capability 9.0+ GPU); ``on`` fails
    elsewhere."""
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    """Schedule and launch step N+1 while the device still runs step N, whose sampled tokens
    feed N+1 on the device; the host reads them back and does its per-token work (detokenize,
    stop checks) during N+1. ``auto``: on with CUDA (hides the host's share of each step), off
    on the CPU (the forward runs on the host, nothing to overlap, and outputs would come one
    step later)."""
    quantization: Literal["none", "int4", "fp8"] = "none"
    """``int4``: on the CPU, run a GGUF's own 4-bit blocks with bf16 activations (engine/quantization.py)
    instead of dequantizing them; on CUDA, every layer projection in group-wise int4 (W4A16),
    quantized at load from any weights (engine/w4a16.py); ``fp8``: every layer projection in e4m3
    with per-channel scales, quantized at load (CUDA with FP8 tensor cores, engine/fp8.py);
    ``none``: dense weights in ``dtype``."""
    lm_head_quantization: Literal["none", "fp8", "int4"] = "none"
    """The lm_head's own format, apart from the layers': ``fp8``, e4m3 per row (CUDA with FP8 tensor
    cores, or the CPU's emulation); ``int4``, groups of 128 (W4A16, CUDA); a tied head gets a copy
    of its own. ``none``: the head stays in ``dtype``, as vLLM keeps it. At batch 1 the 8B's head
    is 1 GB of bf16, an eighth of what an FP8 step reads; its rounding moves every logit. On the
    real Qwen2.5-Coder-1.5B (CPU emulation, 1,064 handbook prompt positions, docs/performance.md)
    an e4m3 head kept 97.6% of the float32 model's next-token choices, an int4 one 92.2%. int4 on
    the CPU runs the GGUF's own head as int4 (engine/quantization.py): leave this ``none`` there."""
    native_decode_step: Literal["auto", "on", "off"] = "auto"
    """With ``quantization="int4"`` on the CPU, every decode-only step (any batch size) runs as
    one native call (engine/native_decode.py, compiled on first use). ``auto``: use it when it builds,
    else warn and stay on PyTorch; ``on``: fail if it cannot be built; ``off``: never."""
    speculative: Literal["off", "ngram", "draft"] = "off"
    """``ngram``: decode steps of at most ``speculative_max_batch`` requests also verify up to
    ``num_speculative_tokens`` tokens proposed by n-gram prompt lookup (engine/speculative.py):
    the same tokens at temperature 0, the same distribution above it, fewer steps when answers
    quote their prompt. ``draft``: the drafts are what ``draft_model``, a smaller model of the same
    tokenizer, says greedily (engine/draft_model.py). Drafts continue the tokens the host
    knows; with async scheduling n-gram drafts go ahead of the step in flight (its token guessed,
    the verifying step launched behind it), while a draft model has that step read back first.
    Steps without drafts, and those of a batch too large to speculate (``speculative_max_batch``),
    stay async."""
    draft_model: str | None = None
    """With ``speculative="draft"``: the draft model's path (any form ``model`` takes). It runs
    as an engine of its own (same device, quantization, block size and context), with a KV cache
    of ``kv_cache_memory_bytes`` (the CPU default on the CPU; a tenth of ``gpu_memory_utilization``
    of the GPU's memory on CUDA, taken before the target's cache is sized)."""
    speculative_draft_cost: float = 0.64
    """A draft model's decode step as a share of the target's (``best_k`` weighs it per draft).
    Measured on the 2-core CPU, int4 + native steps: a Qwen2.5-Coder-0.5B draft step took 35.1 ms
    with the host's work against 54.9 ms for a 1.5B decode step (docs/performance.md). With a
    draft row's 0.45 on top, a draft there costs more than the token it may save, so no number of
    drafts pays and requests do not draft: on that CPU n-gram lookup (free drafts) is the one that
    pays. A launch-bound GPU step of a small model costs nearly a full step too."""
    speculative_answer_cache_tokens: int = 1 << 15
    """With ``speculative="ngram"``: the last requests' outputs kept (this many tokens at most),
    so that a request whose own tokens do not continue its last n-gram may draft what a recent
    answer said next (engine/speculative.py AnswerCache); 0: prompt lookup only. At the default
    the index took 24 MB (39 MB at its peak, before a rebuild) for 3,000 answers of random tokens,
    the worst case, where every n-gram is new."""
    speculative_ngram_sizes: tuple[int, int] = (2, 4)
    """With ``speculative="ngram"``: the n-gram lengths (min, max) looked up, longest first. A
    replay of the 1.5B's real handbook answers through the proposer (CPU, 2026-12-06,
    docs/performance.md) counted 1.73x fewer steps at (2, 4) with 4 drafts and 2.04x at (1, 8)
    with 8, where more steps verify. On an H100 (2026-12-07, the 1.5B, bench row cost 0.05) (1, 8)
    with 8 drafts gave 1.48x at batch 1 against 1.41x at (2, 4) with 4, and on another machine
    that day 1.37x against 1.31x; the defaults stay the CPU's."""
    speculative_device: Literal["auto", "on", "off"] = "auto"
    """With ``speculative="ngram"``: while every running request decodes greedily (temperature 0,
    no penalties, no logprobs), up to ``speculative_max_batch`` of them, and none waits, decide
    the drafts, their verification and the next step's inputs on the device, so that a verifying
    step is launched before the one before it is read back (engine/device_speculation.py); each
    such step verifies ``num_speculative_tokens`` rows a request (and, with
    ``speculative_device_rests``, it leaves that way for the host's while its drafts do not pay).
    auto: on with CUDA, off on the CPU (each step there is waited for anyway). On an H200 (2026-12-07, the 1.5B, 32 handbook questions, k=4, n-grams
    1..8, docs/performance.md) it decoded 1.47x the plain engine at batch 1 where the host's way
    ran 1.34x, 1.37x against 1.26x at batch 4 and 1.28x against 1.30x at batch 8, the answers
    token for token the host's (31/32 the plain engine's, the other parting at a near-tie)."""
    speculative_device_rests: bool = False
    """Let device speculation leave for the host's way while its steps gain less than their rows
    cost (``StepYield``, priced at ``speculative_row_cost``), until a draft verified there stands.
    Off: on an H100 (2026-12-08, the 1.5B, 32 handbook questions, n-grams 1..8, batch 1,
    docs/performance.md) resting cost more than it saved, k=4 1.57x with rests at row cost 0.05,
    1.59x at 0.02 and 1.67x never resting, k=8 1.62x, 1.64x and 1.69x, batch 4 1.31x against 1.39x:
    leaving and coming back each read a step back, and a device step of 5 rows costs only 1.08
    one-row steps."""
    num_speculative_tokens: int = 4
    """Drafts a verifying step proposes at most (``k``): each costs one more row in the step."""
    speculative_row_cost: float | None = None
    """What one more row costs in a decode step, as a share of a one-row step: each step proposes
    only as many drafts as pay at the request's measured acceptance (engine/speculative.py
    ``best_k``). None: the device's (``ROW_COST_BY_DEVICE``, :meth:`row_cost`)."""
    speculative_max_batch: int = 8
    """Speculate only while at most this many requests decode: a larger batch's step is no longer
    bound by reading the weights, and rows for drafts then cost about what they might save. The
    2-core CPU, Qwen2.5-Coder-1.5B int4 (docs/performance.md): 1.54x at batch 1, 1.16x at 4, 1.12x
    at 8, 0.98x at 16. On CUDA a verifying step of up to this many requests replays a row graph
    (``row_cuda_graphs``). On the H200 with the 1.5B and handbook questions (2026-12-04), n-gram
    drafts gave 1.37x at batch 1, 1.36x at 2 and 1.21x at 8, but a group of 32 finished 0.89x
    as fast (its tail drafted), and the 0.5B draft model 0.90-0.99x: there speculation is off by
    default (the assistant's ``auto``). With async scheduling a request that has decoded in a
    larger batch never drafts (``EngineCore._draft_wants``): the tail of a large batch is where
    drafting lost."""
    warm_up: Literal["auto", "on", "off"] = "auto"
    """Before serving, run a few throwaway requests (short and long prompts, a prefix-cache hit,
    a mixed step, two decode steps each) so that the kernels the captured graphs leave out -
    prefill attention, its split merge, RoPE + KV write, decode attention in a mixed step -
    compile now rather than in a user's request (on a fresh Triton cache: a 2.5 s first prefill,
    a 0.61 s first mixed step on the H200, 2026-11-30). ``auto``: on with CUDA (the CPU path
    compiles nothing)."""
    cache_dir: Path | None = None  # None: default_cache_dir()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad setting."""
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto/float32/bfloat16/float16, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.mixed_cuda_graph_max_chunk < 0 or self.mixed_cuda_graph_max_decodes < 0 or self.mixed_cuda_graph_max_graphs < 0
                or self.mixed_cuda_graph_start_chunk < 0):
            raise ConfigError("mixed_cuda_graph_max_chunk and _max_decodes must be >= 0 (chunk 0: off), _max_graphs and _start_chunk "
                              f">= 0; got {self.mixed_cuda_graph_max_chunk}, {self.mixed_cuda_graph_max_decodes}, "
                              f"{self.mixed_cuda_graph_max_graphs}, {self.mixed_cuda_graph_start_chunk}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be >= 2 (one is the reserved null block), got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"attention_backend must be auto/torch/triton, got {self.attention_backend!r}")
        if self.quantization not in ("none", "int4", "fp8"):
            raise ConfigError(f"quantization must be 'none', 'int4' or 'fp8', got {self.quantization!r}")
        if self.quantization != "none" and self.dtype not in ("auto", "bfloat16"):
            raise ConfigError(f"quantization={self.quantization!r} runs bf16 activations; dtype {self.dtype!r} is not possible with it")
        if self.lm_head_quantization not in ("none", "fp8", "int4"):
            raise ConfigError(f"lm_head_quantization must be 'none', 'fp8' or 'int4', got {self.lm_head_quantization!r}")
        if self.lm_head_quantization != "none" and self.dtype not in ("auto", "bfloat16"):
            raise ConfigError(f"lm_head_quantization={self.lm_head_quantization!r} runs bf16 activations; dtype {self.dtype!r} "
                              "is not possible with it")
        if self.row_cuda_graphs not in ("auto", "on", "off"):
            raise ConfigError(f"row_cuda_graphs must be auto/on/off, got {self.row_cuda_graphs!r}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(f"async_scheduling must be auto/on/off, got {self.async_scheduling!r}")
        if self.speculative not in ("off", "ngram", "draft"):
            raise ConfigError(f"speculative must be 'off', 'ngram' or 'draft', got {self.speculative!r}")
        if self.speculative_device not in ("auto", "on", "off"):
            raise ConfigError(f"speculative_device must be auto/on/off, got {self.speculative_device!r}")
        if self.speculative_device == "on" and self.speculative != "ngram":
            raise ConfigError(f"speculative_device='on' needs speculative='ngram' (its drafts are n-gram lookups on the device), "
                              f"got speculative={self.speculative!r}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ConfigError("speculative='draft' and draft_model go together: name the draft model's path with "
                              f"speculative='draft' (got speculative={self.speculative!r}, draft_model={self.draft_model!r})")
        if self.draft_model is not None and not Path(self.draft_model).exists():
            raise ConfigError(f"draft model path does not exist: {self.draft_model}")
        if self.speculative_draft_cost < 0:
            raise ConfigError(f"speculative_draft_cost must be >= 0, got {self.speculative_draft_cost}")
        if self.speculative_row_cost is not None and self.speculative_row_cost < 0:
            raise ConfigError(f"speculative_row_cost must be >= 0, got {self.speculative_row_cost}")
        if self.speculative_answer_cache_tokens < 0:
            raise ConfigError(f"speculative_answer_cache_tokens must be >= 0, got {self.speculative_answer_cache_tokens}")
        sizes = self.speculative_ngram_sizes
        if len(sizes) != 2 or not 1 <= sizes[0] <= sizes[1]:
            raise ConfigError(f"speculative_ngram_sizes must be (min, max) with 1 <= min <= max, got {self.speculative_ngram_sizes}")
        if self.num_speculative_tokens < 1 or self.speculative_max_batch < 1:
            raise ConfigError(f"num_speculative_tokens and speculative_max_batch must be >= 1, got {self.num_speculative_tokens} "
                              f"and {self.speculative_max_batch}")
        if self.pdl not in ("auto", "on", "off"):
            raise ConfigError(f"pdl must be auto/on/off, got {self.pdl!r}")
        if self.pdl == "on" and not self.batch1_gemv:
            raise ConfigError("pdl='on' applies to the batch-1 GEMVs: it needs batch1_gemv=True")
        if self.warm_up not in ("auto", "on", "off"):
            raise ConfigError(f"warm_up must be auto/on/off, got {self.warm_up!r}")
        if self.native_decode_step not in ("auto", "on", "off"):
            raise ConfigError(f"native_decode_step must be auto/on/off, got {self.native_decode_step!r}")
        if self.native_decode_step == "on" and self.quantization != "int4":
            raise ConfigError("native_decode_step='on' runs the GGUF's int4 blocks: it needs quantization='int4'")
        path = Path(self.model)
        if not path.exists():
            raise ConfigError(f"model path does not exist: {self.model}")

    def row_cost(self, device_type: str) -> float:
        """``speculative_row_cost`` on a device of this type (``"cpu"``, ``"cuda"``): the setting, or
        the device's measured one when unset (another device type: the CPU's, the dearer)."""
        if self.speculative_row_cost is not None:
            return self.speculative_row_cost
        return ROW_COST_BY_DEVICE.get(device_type, ROW_COST_BY_DEVICE["cpu"])

    def device_speculation(self, device_type: str) -> bool:
        """Whether n-gram speculation is decided on a device of this type (``speculative_device``)."""
        return self.speculative == "ngram" and (self.speculative_device == "on" or (self.speculative_device == "auto" and device_type == "cuda"))

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
