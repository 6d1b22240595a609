"""The native CPU decode step: decode-only (and short) steps run as one C call (the CPU's "CUDA graph").

At batch 1 on a 2-core CPU the eager PyTorch step of SmolLM2-135M spends more time dispatching
~900 small ops than multiplying (see docs/performance.md). ``engine/kernels/native_decode.c`` runs
the whole step (embedding to logits) over the GGUF's own Q4_1/Q8_0 blocks (other types repacked
into those by engine/gguf_blocks.py) with integer dot products, Qwen2's q|k|v biases added,
reading and writing the same paged bf16 KV cache as the PyTorch path, so a request can
prefill through PyTorch and decode here. It is compiled on first use with the machine's C
compiler (``-O3 -march=native -fopenmp``) into the engine cache. A step of at most
:data:`NATIVE_MAX_TOKENS` tokens (:data:`NATIVE_MAX_TOKENS_BF16` on a CPU with bf16 matmuls in
hardware, where the dense bf16 PyTorch path takes longer chunks faster) runs here too, prefill chunks included (one row per token; a
row's K/V is written before any row attends, so a chunk's later tokens see its earlier ones; the
matrices take the tokens in tiles of 8 that share each unpacked weight block (two blocks a
512-bit register on CPUs with AVX-512 VNNI, one a 256-bit register elsewhere), a request's rows
share each K/V chunk in attention, and the head runs for the sampled rows only):
without hardware bf16 matmuls PyTorch's int4 kernel prefilled Qwen2.5-1.5B's 128-token prompt
in 13-16 s on a shared 2-core Xeon (2026-12-01), far too slow for a question after a cached
prefix. Longer prefills stay on the PyTorch path. A decode step of any batch size runs here:
each weight row is read from memory once per step and reused for every request's activations, so the aggregate rate grows with the
batch (engine.bench's ``decode-scaling`` suite shows 1 to 32 streams).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.gguf_blocks import BlockCache, Blocks
from engine.gguf_file import unpermute_rows
from engine.quantization import bf16_matmuls, cpu_flags

SOURCE = Path(__file__).parent / "kernels" / "native_decode.c"
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
QK = 32
NATIVE_MAX_TOKENS = 64  # a step of up to this many tokens runs natively: the activations of one
# matrix pass (64 rows x up to 8960 int8) stay in L2 while each weight row is reused for all of them
NATIVE_MAX_TOKENS_BF16 = 16  # ... where the CPU has hardware bf16 matmuls: above it the int4 model's
# dense bf16 path is faster (a question after a cached 2,000-token prefix on a 2-core EPYC,
# 2026-12-02, Qwen2.5-1.5B and SmolLM2 alike: even at 16 tokens, 1.2-1.9x for PyTorch at 30-48)
Q4_1, Q8_0 = 0, 1  # matrix_t.type in the C source
SIMD_NAMES = {0: "scalar", 1: "AVX2", 2: "AVX-VNNI", 3: "AVX-512 VNNI"}


class NativeDecodeError(RuntimeError):
    """The native decode step cannot be built or cannot run this model."""


# ---- build --------------------------------------------------------------------------------------
def _cpu_signature() -> str:
    """The CPU's feature flags: ``-march=native`` objects are only valid on the same kind of CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def build_library(cache_dir: Path, march: str = "native", wide: bool = True) -> ctypes.CDLL:
    """Compile the C source once per (source, compiler, flags, CPU) into ``cache_dir`` and load it.
    ``march`` other than ``native`` (e.g. ``haswell``: AVX2 without VNNI; ``x86-64``: scalar)
    builds the portable paths, for tests. ``wide=False`` leaves out the AVX-512 tile (two blocks a
    register) on CPUs that have it: the 256-bit tile, a benchmark's baseline."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise NativeDecodeError(f"no C compiler {cc!r} on PATH (install one, e.g. `apt install gcc`, or set "
                                "native_decode_step='off')")
    source = SOURCE.read_bytes()
    flags = (*FLAGS, f"-march={march}", *(() if wide else ("-DNATIVE_TILE_256",)))
    key = hashlib.sha256(source + " ".join((cc, *flags, _cpu_signature())).encode()).hexdigest()[:16]
    target = cache_dir / "native" / f"native_decode-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            proc = subprocess.run([cc, *flags, "-o", str(out), str(SOURCE), "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise NativeDecodeError(f"compiling {SOURCE.name} failed:\n{proc.stderr.strip()}")
            os.replace(out, target)  # atomic: a concurrent engine sees the old or the new file
    lib = ctypes.CDLL(str(target))
    lib.decode_step.restype = ctypes.c_int
    lib.decode_step.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_int]
    lib.simd_level.restype = ctypes.c_int
    return lib


def native_max_tokens(flags: frozenset[str] | None) -> int:
    """Tokens up to which a step that is not decode-only runs natively on a CPU with ``flags``
    (:func:`engine.quantization.cpu_flags`): fewer where the int4 model's dense bf16 path runs
    longer steps (:func:`engine.quantization.bf16_matmuls`, the rule its Int4Linear follows)."""
    return NATIVE_MAX_TOKENS_BF16 if bf16_matmuls(flags) else NATIVE_MAX_TOKENS


# ---- the C structs ------------------------------------------------------------------------------
class _Matrix(ctypes.Structure):
    _fields_ = [("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("type", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32)]


MAX_PARTS = 3  # row blocks of one fused output: q|k|v


class _Fused(ctypes.Structure):
    _fields_ = [("part", _Matrix * MAX_PARTS), ("parts", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", _Fused), ("qkv_bias", ctypes.c_void_p), ("o", _Fused), ("gate_up", _Fused), ("down", _Fused)]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int32) for name in
                  ("hidden", "heads", "kv_heads", "head_dim", "inter", "layers", "vocab", "page", "rope_len")),
                ("eps", ctypes.c_float), ("embed", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("head", _Fused), ("layer", ctypes.c_void_p)]


def _fused(matrices: list["BlockMatrix"]) -> _Fused:
    """Row blocks of one output (q|k|v, gate|up, or a single matrix), each in its own format."""
    if not 1 <= len(matrices) <= MAX_PARTS or len({m.shape[1] for m in matrices}) != 1:
        raise NativeDecodeError(f"a fused projection takes 1 to {MAX_PARTS} matrices of one width")
    return _Fused((_Matrix * MAX_PARTS)(*(m.struct() for m in matrices)), len(matrices))


# ---- weights in the C layout --------------------------------------------------------------------
@dataclass
class BlockMatrix:
    """One matrix [n, k] as GGUF blocks, in the layout of the C ``matrix_t``."""

    type: int
    qs: np.ndarray  # Q4_1: uint8 [n, k/32, 16] nibbles; Q8_0: int8 [n, k]
    d: np.ndarray  # float32 [n, k/32]
    m: np.ndarray | None  # float32 [n, k/32] (Q4_1 only)

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * QK

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + (self.m.nbytes if self.m is not None else 0)

    @classmethod
    def from_blocks(cls, blocks: Blocks) -> "BlockMatrix":
        """Q4_1 or Q8_0 :class:`~engine.gguf_blocks.Blocks` in the C layout."""
        q = blocks.q
        if blocks.is_q4_1:  # back to GGUF's nibble packing: weight j and j + 16 of a block share byte j
            rows, cols = q.shape
            grouped = q.reshape(rows, cols // QK, QK).astype(np.uint8)
            q = grouped[..., :16] | (grouped[..., 16:] << 4)
        return cls(Q4_1 if blocks.is_q4_1 else Q8_0, *(None if a is None else np.ascontiguousarray(a) for a in (q, blocks.d, blocks.m)))

    def struct(self) -> _Matrix:
        n, k = self.shape
        return _Matrix(self.qs.ctypes.data, self.d.ctypes.data, self.m.ctypes.data if self.m is not None else None, self.type, n, k)


def block_matrix(blocks: Blocks, unpermute_heads: int | None = None) -> BlockMatrix:
    """A GGUF matrix's :class:`~engine.gguf_blocks.Blocks` (any type
    :func:`~engine.gguf_blocks.tensor_blocks` reads) as a :class:`BlockMatrix`; Q/K rows
    un-permuted like the loader does for llama files."""

    if unpermute_heads is not None:
        blocks = Blocks(*(None if a is None else unpermute_rows(a, unpermute_heads) for a in (blocks.q, blocks.d, blocks.m)))
    return BlockMatrix.from_blocks(blocks)


@dataclass
class NativeLayer:
    """One layer's matrices in the C layout; q|k|v and gate|up stay separate matrices (each may
    be Q4_1 or Q8_0) that the C step fills one output from."""

    qkv: list[BlockMatrix]
    qkv_bias: np.ndarray | None  # float32 q|k|v biases (Qwen2), None without
    o: BlockMatrix
    gate_up: list[BlockMatrix]
    down: BlockMatrix

    @property
    def nbytes(self) -> int:
        return (sum(m.nbytes for m in (*self.qkv, self.o, *self.gate_up, self.down))
                + (self.qkv_bias.nbytes if self.qkv_bias is not None else 0))


@dataclass
class NativeWeights:
    """Every matrix of a GGUF in the C layout (Q4_1/Q8_0 blocks): per layer q|k|v (+ biases), o,
    gate|up, down; the head."""

    layers: list[NativeLayer]
    head: BlockMatrix

    @classmethod
    def from_gguf(cls, blocks: BlockCache, cfg: ModelConfig) -> "NativeWeights":
        """From the blocks of the model's file (shared with its int4 and dense copies in one load)."""
        tensors = blocks.tensors
        mat = lambda name, heads=None: block_matrix(blocks[name], heads)  # noqa: E731
        permuted = cfg.architecture == "llama"  # llama.cpp interleaves llama's Q/K rows, not qwen2's
        layers = []
        for i in range(cfg.num_hidden_layers):
            b = f"blk.{i}."
            qkv = [mat(b + "attn_q.weight", cfg.num_attention_heads if permuted else None),
                   mat(b + "attn_k.weight", cfg.num_key_value_heads if permuted else None), mat(b + "attn_v.weight")]
            bias = None
            if cfg.attention_bias:  # the file's float32 values, not the bf16 model's copy
                bias = np.concatenate([np.asarray(tensors[f"{b}attn_{x}.bias"].data, dtype=np.float32) for x in "qkv"])
            layers.append(NativeLayer(qkv, bias, mat(b + "attn_output.weight"),
                                      [mat(b + "ffn_gate.weight"), mat(b + "ffn_up.weight")], mat(b + "ffn_down.weight")))
        return cls(layers, mat("output.weight" if "output.weight" in tensors else "token_embd.weight"))

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + sum(layer.nbytes for layer in self.layers)


# ---- how many threads a step takes -------------------------------------------------------------
@dataclass
class ThreadChoice:
    """The threads a native step runs on: all of ``max_threads`` while the cores are the engine's,
    one while another process holds a core (speech recognition or synthesis beside the LLM on a
    small CPU). A step's threads meet at ~340 barriers (a few per layer); when one thread is
    descheduled each barrier waits for it. The 2-core Xeon, the 1.5B at batch 1, one core kept busy
    by another process (2026-12-03 20:04-20:06 UTC, engine/bench/experiments/native_contention.py,
    two interleaved rounds): 2 threads 3.2-4.4 tok/s, 1 thread 10.1-10.3, this choice 8.8-9.0;
    idle 19.3-19.8, 10.3-10.4 and 19.2-19.4. In the voice bench (1 caller, 10 turns, one run each)
    native steps averaged 149.6 ms on fixed 2 threads, 196.5 with timed tries alone (no idle-time
    signal) and 167.5 with this choice.

    Contention shows in the calling thread (one of the step's threads): its CPU time over the
    step's wall time drops below ``busy_ratio`` (a thread waiting at a barrier spins, so an idle
    machine keeps it near 1). Then steps run on one thread until the machine's idle time during
    one of them (``idle_s``, from /proc/stat) shows the other cores free again: at least
    ``free_ratio`` of their share of the step's wall time. Where that cannot be read, a step tries
    all threads after a wait that starts at ``retry_s`` and doubles with each try that finds the
    cores still shared, up to ``max_retry_s``. ``adaptive=False``: always ``max_threads``
    (benchmarks' fixed A/Bs)."""

    max_threads: int
    adaptive: bool = True
    busy_ratio: float = 0.8
    free_ratio: float = 0.6
    retry_s: float = 1.0
    max_retry_s: float = 16.0
    min_wall_s: float = 0.002  # shorter steps say too little about the scheduler
    threads: int = 0
    since: float = 0.0  # when the steps went down to one thread
    wait_s: float = 0.0
    trying: bool = False  # the next recorded step is a try on all threads after a wait

    def __post_init__(self) -> None:
        self.threads = self.threads or self.max_threads
        self.wait_s = self.wait_s or self.retry_s

    def for_step(self, now: float) -> int:
        """The threads the next step (starting at ``now``, seconds) takes."""
        if not self.adaptive:
            return self.max_threads
        if self.threads < self.max_threads and now - self.since >= self.wait_s:
            self.threads, self.trying = self.max_threads, True
        return self.threads

    def record(self, threads: int, wall_s: float, cpu_s: float, now: float, idle_s: float | None = None) -> None:
        """A step on ``threads`` took ``wall_s``, of which the calling thread ran ``cpu_s``; the
        machine's cores were idle ``idle_s`` in all during it (None: unknown)."""
        if not self.adaptive or wall_s < self.min_wall_s:
            return
        if threads == 1:
            if idle_s is not None and idle_s >= self.free_ratio * wall_s * (self.max_threads - 1):
                self.threads, self.wait_s = self.max_threads, self.retry_s  # the other cores sat idle
            return
        if cpu_s < self.busy_ratio * wall_s:  # the cores are shared: one thread, for longer after a failed try
            self.wait_s = min(self.wait_s * 2, self.max_retry_s) if self.trying else self.retry_s
            self.threads, self.since = 1, now
        else:
            self.wait_s = self.retry_s
        self.trying = False


def idle_seconds() -> float | None:
    """The machine's idle time so far, all cores together (/proc/stat), None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")  # idle + iowait
    except (OSError, ValueError, IndexError):
        return None


# ---- the step ----------------------------------------------------------------------------------
class NativeDecodeStep:
    """Runs decode-only steps of any number of requests over :class:`NativeWeights`."""

    def __init__(self, lib: ctypes.CDLL, model: torch.nn.Module, weights: NativeWeights, kv_storage: torch.Tensor,
                 block_size: int) -> None:
        cfg: ModelConfig = model.config
        if kv_storage.dtype != torch.bfloat16 or not kv_storage.is_contiguous() or kv_storage.device.type != "cpu":
            raise NativeDecodeError("the native decode step needs a contiguous bfloat16 KV cache on the CPU")
        self.lib, self.kv, self.weights = lib, kv_storage, weights
        self.num_blocks = kv_storage.shape[2]
        self.vocab = cfg.vocab_size
        self.thread_choice = ThreadChoice(torch.get_num_threads())
        self.max_tokens = native_max_tokens(cpu_flags())  # steps with prefill chunks up to this run here
        # Keep every array the C structs point to alive for the kernel's lifetime.
        fp32 = lambda t: t.detach().float().contiguous()  # noqa: E731
        self.embed = model.embed_tokens.weight.detach().to(torch.bfloat16).contiguous()
        self.cos_sin = model.rope.cos_sin.float().contiguous()
        self.final_norm = fp32(model.norm.weight)
        self.norms = [fp32(w) for layer in model.layers for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        self.layers = (_Layer * len(weights.layers))(*(
            _Layer(self.norms[2 * i].data_ptr(), self.norms[2 * i + 1].data_ptr(), _fused(w.qkv),
                   None if w.qkv_bias is None else w.qkv_bias.ctypes.data, _fused([w.o]), _fused(w.gate_up), _fused([w.down]))
            for i, w in enumerate(weights.layers)))
        self.struct = _Model(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size, block_size,
                             self.cos_sin.shape[0], cfg.rms_norm_eps, self.embed.data_ptr(), self.cos_sin.data_ptr(),
                             self.final_norm.data_ptr(), _fused([weights.head]), ctypes.addressof(self.layers))

    @property
    def weight_bytes_per_step(self) -> int:
        """Weight bytes one step reads: every block matrix and norm (one embedding row aside).
        The block copies live on the :class:`~engine.engine_core.LoadedModel`; the embedding and
        the RoPE table are the model's own."""
        return self.weights.nbytes + sum(t.nbytes for t in (self.final_norm, *self.norms))

    @property
    def simd(self) -> str:
        return SIMD_NAMES[self.lib.simd_level()]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor | None = None,
            tiled: bool = True) -> torch.Tensor:
        """Logits [B, vocab] float32 of one step, or [len(rows), vocab] of ``rows`` only (the
        head runs for those alone: a prefill chunk samples its last row, or none); writes the step's K/V
        into the cache. ``input_ids``/``positions`` [B] and ``block_tables`` [B, width] are int64
        CPU tensors. ``tiled=False`` runs one row per token, the earlier kernel (a benchmark's baseline)."""
        b = input_ids.shape[0]
        if b < 1:
            raise NativeDecodeError("the native decode step runs at least one request, got none")
        ids, pos, tables = (t.to(torch.int64).contiguous() for t in (input_ids, positions, block_tables))
        out = None if rows is None else rows.to(torch.int64).contiguous()
        logits = torch.empty(b if out is None else len(out), self.vocab, dtype=torch.float32)
        threads = self.thread_choice.for_step(time.monotonic())
        # the machine's idle time only matters on one thread (whether the other cores are free again)
        idle = idle_seconds() if threads == 1 else None
        wall, cpu = time.perf_counter(), time.thread_time()
        rc = self.lib.decode_step(ctypes.addressof(self.struct), b, ids.data_ptr(), pos.data_ptr(), tables.data_ptr(),
                                  tables.shape[1], self.kv.data_ptr(), self.num_blocks, None if out is None else out.data_ptr(),
                                  len(logits), logits.data_ptr(), threads, int(tiled))
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        idle_after = idle_seconds() if idle is not None else None
        self.thread_choice.record(threads, wall, cpu, time.monotonic(), None if idle_after is None else idle_after - idle)
        if rc != 0:
            raise NativeDecodeError(f"decode_step failed with code {rc} (a token id, position, block id or row out of range, or out of memory)")
        return logits
