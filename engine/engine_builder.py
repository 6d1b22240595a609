"""Engine set-up: from a config (and optionally weights already loaded) to a running EngineCore.

Load the weights, size the KV cache (on CUDA from a profiled prefill's activation peak), allocate
it, choose the batch-1 GEMV policy, build the native CPU decode step or capture the CUDA graphs,
then warm the step loop up. :class:`~engine.engine_core.EngineCore` receives the parts and only
runs steps.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

import logging

import torch

from engine.attention import select_backend
from engine.block_manager import BlockManager
from engine.config import ConfigError, EngineConfig, ModelConfig, default_cache_dir
from engine.draft_model import DraftModelProposer
from engine.engine_core import EngineCore
from engine.kernels.gemv_policy import GemvPolicy
from engine.kernels.linear import DECODE_MAX_ROWS
from engine.kernels.triton_utils import pdl_supported, triton_available
from engine.kv_cache import FP8_DTYPE, KVCache, KVCacheSpec
from engine.loaded_model import LoadedModel
from engine.loader import has_tokenizer
from engine.memory import MemoryLedger, tensor_bytes
from engine.model_runner import ModelRunner
from engine.native_decode import NativeDecodeError, NativeDecodeStep, build_library
from engine.profiling import KVBudget, kv_budget_after_profile
from engine.scheduler import Scheduler, SchedulerConfig, StepBoundPolicy
from engine.device_speculation import DeviceSpeculation
from engine.speculative import AnswerCache, NgramProposer, Proposer
from engine.tokenizer import Tokenizer
from engine.w4a16 import other_layout_bytes

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
INT4_LAYOUTS_OWNER = "weights (int4: the same groups again for tinygemm and the pairs GEMV)"


def build_engine(
    config: EngineConfig, loaded: LoadedModel | None = None, *, gemv: GemvPolicy | None = None,
    step_bound: StepBoundPolicy | None = None, capture_lock: AbstractContextManager | None = None,
    draft_loaded: LoadedModel | None = None,
) -> EngineCore:
    """An engine ready to serve: ``loaded`` reuses weights already loaded (benchmarks build
    several engines on one model), ``draft_loaded`` a draft model's (``speculative="draft"``);
    ``gemv`` overrides the config's batch-1 GEMV policy (tests run
    each variant in Triton's interpreter on the CPU); ``step_bound`` is the scheduler's per-step
    bound on background work (:class:`~engine.scheduler.StepBound`; a voice co-scheduler's);
    ``capture_lock`` is held around every CUDA graph capture, here and while serving, so that
    other GPU work of the process that holds it too (a speech model's batches) never runs during
    a capture (a capture fails when another thread touches the GPU the wrong way meanwhile)."""
    config.validate()
    tokenizers = _draft_tokenizers(config) if loaded is None and draft_loaded is None else None
    loaded = loaded or LoadedModel.load(config, tokenizer=tokenizers and tokenizers[0])
    device, mc = loaded.device, loaded.model_config
    memory = MemoryLedger(str(device))
    layouts = other_layout_bytes(loaded.model)
    memory.record("weights", tensor_bytes(loaded.model) - layouts)
    if layouts:
        memory.record(INT4_LAYOUTS_OWNER, layouts)
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's {mc.max_position_embeddings} positions")
    if config.speculative != "off" and config.num_speculative_tokens >= max_model_len:
        raise ConfigError(f"num_speculative_tokens={config.num_speculative_tokens} leaves no room in a {max_model_len}-token context")
    # the draft engine first: on CUDA its memory is then in use when the target's KV cache is sized
    proposer = _proposer(config, loaded, draft_loaded, max_model_len, memory, capture_lock, tokenizers and tokenizers[1])
    backend = select_backend(config.attention_backend, device)
    check_kv_cache_dtype(config, device, backend.name)
    spec = KVCacheSpec.for_model(mc, config.block_size, FP8_DTYPE if config.kv_cache_dtype == "fp8" else loaded.dtype)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    else:
        budget = _kv_budget(config, loaded, memory, spec, max_model_len)
        num_blocks = spec.num_blocks_for_budget(budget.nbytes)
        if num_blocks * config.block_size < max_model_len:
            raise ConfigError(
                f"the KV cache does not fit one {max_model_len}-token sequence: its budget is "
                f"{budget.nbytes / 2**30:.3f} GiB ({budget.explanation}), {num_blocks} blocks of {config.block_size} tokens "
                f"at {spec.bytes_per_block / 2**20:.2f} MiB each = {num_blocks * config.block_size} tokens. Raise "
                f"gpu_memory_utilization (or kv_cache_memory_bytes), lower max_model_len, or free device memory")
    if num_blocks < 2:
        raise ConfigError(f"the KV cache budget holds {num_blocks} blocks; at least 2 are needed")
    kv_cache = KVCache(spec, num_blocks, device)
    memory.record(kv_cache.ledger_name, kv_cache.nbytes)
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    graphs = config.enable_cuda_graphs and device.type == "cuda" and backend.name == "triton"
    piecewise = [t for t in config.piecewise_cuda_graph_sizes if t <= config.max_num_batched_tokens] if graphs else []
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_model_len=max_model_len,
            step_token_buckets=tuple(sorted(set(piecewise))),
            beside_decodes_max_chunk=config.mixed_cuda_graph_start_chunk,
        ),
        block_manager,
        step_bound,
    )
    gemv = gemv if gemv is not None else gemv_policy(config, device, loaded.model_config)
    native = None
    if config.quantization == "int4" and device.type == "cpu" and config.native_decode_step != "off":
        native = _native_decode_step(config, loaded, kv_cache, memory)
    runner = ModelRunner(loaded.model, kv_cache, backend, block_manager, device, gemv, native)
    if graphs:
        with capture_lock or nullcontext():
            _capture_graphs(runner, config, max_model_len, piecewise, memory, capture_lock or nullcontext())
    device_speculation = None
    if config.device_speculation(device.type):
        with capture_lock or nullcontext():
            device_speculation = _device_speculation(runner, config, max_model_len, memory, graphs)
    core = EngineCore(config, loaded, memory, max_model_len, kv_cache, block_manager, scheduler, runner, proposer,
                      device_speculation)
    if config.warm_up == "on" or (config.warm_up == "auto" and device.type == "cuda"):
        core.warm_up()
    return core


def _draft_tokenizers(config: EngineConfig) -> tuple[Tokenizer, Tokenizer] | None:
    """With ``speculative="draft"``, the target's and the draft's tokenizers, loaded and compared
    before any weights (a 1.5B target takes seconds to load only to be refused): the one-line
    refusal if they differ; None where they cannot be compared yet (one has none, or dummy weights,
    whose borrowed tokenizer is padded at load)."""
    if config.speculative != "draft" or config.load_format == "dummy":
        return None
    draft = replace(config, model=config.draft_model, tokenizer=None)
    if not (config.tokenizer or has_tokenizer(config)) or not has_tokenizer(draft):
        return None
    target = Tokenizer.load(config.tokenizer or config.model, config.cache_dir)
    draft_tokenizer = Tokenizer.load(config.draft_model, config.cache_dir)
    if not same_vocabulary(target, draft_tokenizer):
        raise other_tokenizer_error(config.draft_model)
    return target, draft_tokenizer


def _proposer(config: EngineConfig, loaded: LoadedModel, draft_loaded: LoadedModel | None, max_model_len: int,
              memory: MemoryLedger, capture_lock: AbstractContextManager | None,
              draft_tokenizer: Tokenizer | None = None) -> Proposer | None:
    """The drafts' source for ``config.speculative``: n-gram lookup, or a draft model's engine
    (built here, its weights and KV cache entered in ``memory``), refused unless it reads and
    writes the target's tokens (``draft_tokenizer``: the draft's, compared with the target's
    already by :func:`_draft_tokenizers`)."""
    if config.speculative == "ngram":
        low, high = config.speculative_ngram_sizes
        answers = AnswerCache(config.speculative_answer_cache_tokens, low, high) if config.speculative_answer_cache_tokens else None
        return NgramProposer(config.num_speculative_tokens, low, high, answers=answers)
    if config.speculative != "draft":
        return None
    kv_bytes = config.kv_cache_memory_bytes
    if kv_bytes is None and loaded.device.type == "cuda":
        kv_bytes = int(config.gpu_memory_utilization * torch.cuda.get_device_properties(loaded.device).total_memory / 10)
    draft_config = replace(
        config, model=config.draft_model, speculative="off", draft_model=None, async_scheduling="off", tokenizer=None,
        kv_cache_memory_bytes=kv_bytes, max_model_len=max_model_len,
        row_cuda_graphs="on" if config.row_cuda_graphs == "auto" else config.row_cuda_graphs,
    )
    checked = draft_tokenizer is not None
    if not checked and draft_loaded is None and loaded.tokenizer is not None and has_tokenizer(draft_config):
        # its tokenizer alone first: a draft of another vocabulary is refused before its weights load
        draft_tokenizer = Tokenizer.load(config.draft_model, config.cache_dir)
        if not same_vocabulary(loaded.tokenizer, draft_tokenizer):
            raise other_tokenizer_error(config.draft_model)
        checked = True
    draft_loaded = draft_loaded or LoadedModel.load(draft_config, tokenizer=draft_tokenizer)
    if not checked:
        check_draft_vocabulary(loaded, draft_loaded, config.draft_model)
    if draft_loaded.model_config.max_position_embeddings < max_model_len:
        raise ConfigError(f"the draft model {config.draft_model} has {draft_loaded.model_config.max_position_embeddings} "
                          f"positions, the target's context is {max_model_len}: lower max_model_len")
    draft = build_engine(draft_config, draft_loaded, capture_lock=capture_lock)
    for owner, nbytes in draft.memory.entries.items():
        memory.record(f"draft model: {owner}", nbytes)
    log.info("speculative decoding with the draft model %s", config.draft_model)
    return DraftModelProposer(draft)


def check_draft_vocabulary(target: LoadedModel, draft: LoadedModel, draft_path: str | None) -> None:
    """Refuse a draft model whose token ids mean other text than the target's: its drafts would be
    noise (every one rejected) and its ids may lie outside the target's vocabulary."""
    if target.tokenizer is not None and draft.tokenizer is not None:
        same = same_vocabulary(target.tokenizer, draft.tokenizer)
    else:  # random weights without a tokenizer: only the sizes can be compared
        same = target.model_config.vocab_size == draft.model_config.vocab_size
    if not same:
        raise other_tokenizer_error(draft_path)


def same_vocabulary(target: Tokenizer, draft: Tokenizer) -> bool:
    """Whether both tokenizers map the same text to the same ids."""
    return target.hf.get_vocab() == draft.hf.get_vocab()


def other_tokenizer_error(draft_path: str | None) -> ConfigError:
    """The one-line refusal of a draft model of another tokenizer."""
    return ConfigError(f"the draft model {draft_path} has another tokenizer than the target model (its token ids mean other "
                       f"text): speculative='draft' needs a draft of the same tokenizer, e.g. a smaller model of the same "
                       f"family, or use speculative='ngram'")


def check_kv_cache_dtype(config: EngineConfig, device: torch.device, backend: str) -> None:
    """Refuse an FP8 KV cache, before anything is allocated, where a path would read it as plain
    floats: the native CPU decode step, and Triton's e4m3 below compute capability 8.9."""
    if config.kv_cache_dtype != "fp8":
        return
    if device.type == "cpu" and config.quantization == "int4" and config.native_decode_step != "off":
        raise ConfigError("kv_cache_dtype='fp8' cannot run with the native CPU decode step (engine/native_decode.py reads "
                          "the cache as bf16): use kv_cache_dtype='auto', native_decode_step='off', or quantization='none' "
                          "(the assistant: --quantization none)")
    if device.type == "cuda" and backend == "triton" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"kv_cache_dtype='fp8' needs a compute capability 8.9+ GPU (Ada or Hopper: Triton's e4m3), "
                          f"{torch.cuda.get_device_name(device)} has "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}: use kv_cache_dtype='auto'")


def gemv_policy(config: EngineConfig, device: torch.device, model: ModelConfig) -> GemvPolicy:
    """The batch-1 GEMV policy from the config: Triton GEMVs on CUDA only, PDL where supported."""
    if not (config.batch1_gemv and device.type == "cuda" and triton_available()):
        if config.pdl == "on":
            raise ConfigError(f"pdl='on' needs the Triton batch-1 GEMVs on a CUDA device, not {device}")
        return GemvPolicy()
    pdl = config.pdl == "on" or (config.pdl == "auto" and pdl_supported(device))
    if config.pdl == "on" and not pdl_supported(device):
        raise ConfigError(f"pdl='on' needs compute capability 9.0+, {torch.cuda.get_device_name(device)} has "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    return batch1_policy(model, pdl)


def batch1_policy(model: ModelConfig, pdl: bool) -> GemvPolicy:
    """The batch-1 GEMVs for this model's shape. A model narrower than 4,096 (the 1.5B's 1,536)
    runs down_proj on cuBLAS and o_proj split-K 2: batch-1 graph replay of the 1.5B shape 1.289 ms
    against 1.320 with the 8B's choices (three interleaved rounds, H200, 2026-12-03); on the 8B
    shape the down GEMV wins (4.07 against 4.12 ms) and the split does not pay."""
    narrow = model.hidden_size < 4096
    return GemvPolicy(max_rows=DECODE_MAX_ROWS, pdl=pdl, gemv_down=not narrow, o_split_k=2 if narrow else 1)


def _kv_budget(config: EngineConfig, loaded: LoadedModel, memory: MemoryLedger, spec: KVCacheSpec, max_model_len: int) -> KVBudget:
    """Bytes for the KV cache: as configured, a fixed default on the CPU, or what a profiled
    prefill leaves of ``gpu_memory_utilization`` on CUDA."""
    if config.kv_cache_memory_bytes is not None:
        return KVBudget(config.kv_cache_memory_bytes, "kv_cache_memory_bytes as configured")
    if loaded.device.type != "cuda":
        return cpu_default_kv_budget(spec, max_model_len)
    return kv_budget_after_profile(loaded.model, config, loaded.device, memory, spec, max_model_len)


def cpu_default_kv_budget(spec: KVCacheSpec, max_model_len: int) -> KVBudget:
    """The CPU's KV budget: 1 GiB, or more where one ``max_model_len`` sequence (plus the null
    block) needs more, so that a wide model in float32 (the 1.5B with ``quantization='none'``:
    0.88 MiB a 16-token block, 18,720 tokens in 1 GiB) still starts at its full context."""
    one_sequence = (-(-max_model_len // spec.block_size) + 1) * spec.bytes_per_block
    if one_sequence <= CPU_DEFAULT_KV_BYTES:
        return KVBudget(CPU_DEFAULT_KV_BYTES, "the CPU default")
    return KVBudget(one_sequence, f"the CPU default raised to one {max_model_len}-token sequence")


def _native_decode_step(config: EngineConfig, loaded: LoadedModel, kv_cache: KVCache, memory: MemoryLedger) -> NativeDecodeStep | None:
    """Decode-only steps as one native call (engine/native_decode.py); None where it
    cannot be built and the config allows PyTorch instead."""
    try:
        lib = build_library(config.cache_dir or default_cache_dir())
        step = NativeDecodeStep(lib, loaded.model, loaded.ensure_native_weights(config), kv_cache.storage, config.block_size)
    except NativeDecodeError as e:
        if config.native_decode_step == "on":
            raise ConfigError(f"native_decode_step='on': {e}") from e
        log.warning("native CPU decode step unavailable, decoding through PyTorch: %s", e)
        return None
    memory.record("weights (native decode layout)", step.weight_bytes_per_step)
    log.info("native CPU decode step: %s, %d threads, every decode-only step", step.simd, step.thread_choice.max_threads)
    return step


def _device_speculation(runner: ModelRunner, config: EngineConfig, max_model_len: int, memory: MemoryLedger,
                        graphs: bool) -> DeviceSpeculation:
    """Device speculation's state for up to ``speculative_max_batch`` requests and, with ``graphs``,
    its step per bucket of them as a CUDA graph; their device memory goes into the ledger."""
    low, high = config.speculative_ngram_sizes
    cuda = runner.device.type == "cuda"
    before = torch.cuda.memory_reserved(runner.device) if cuda else 0
    spec = DeviceSpeculation(runner, config.num_speculative_tokens, low, high, min(config.speculative_max_batch, config.max_num_seqs),
                             max_model_len, capture=graphs)
    if cuda:
        memory.record("device speculation (token history, graphs)", torch.cuda.memory_reserved(runner.device) - before)
    log.info("device speculation: k=%d, n-grams %d..%d, up to %d requests, buckets %s", config.num_speculative_tokens, low, high,
             spec.max_requests, spec.buckets)
    return spec


def row_graph_sizes(config: EngineConfig) -> list[int]:
    """The row graphs' buckets (rows = tokens): ``cuda_graph_batch_sizes`` from 2 up to the
    largest verifying step, ``speculative_max_batch`` requests of ``num_speculative_tokens + 1``
    tokens; none unless ``row_cuda_graphs`` is on (``auto``: with speculative decoding)."""
    if config.row_cuda_graphs == "off" or (config.row_cuda_graphs == "auto" and config.speculative == "off"):
        return []
    largest = min(config.speculative_max_batch, config.max_num_seqs) * (config.num_speculative_tokens + 1)
    sizes = [b for b in config.cuda_graph_batch_sizes if 2 <= b < largest]
    return sizes + [largest]


def _capture_graphs(runner: ModelRunner, config: EngineConfig, max_model_len: int, piecewise: list[int], memory: MemoryLedger,
                    capture_lock: AbstractContextManager) -> None:  # fmt: skip
    """Decode graphs, piecewise graphs for ``piecewise`` token counts, and the mixed-step
    graphs' runner, its chunks bucketed like the piecewise graphs' token counts, with its lone
    chunks (and up to ``mixed_cuda_graph_start_chunk``, every decode bucket's) captured now (it
    captures other shapes while serving); their memory pool goes into the ledger."""
    device = runner.device
    sizes = [b for b in config.cuda_graph_batch_sizes if b <= config.max_num_seqs] or [config.max_num_seqs]
    torch.cuda.empty_cache()  # capturing does this first: from here the difference is the graphs' pool
    before = torch.cuda.memory_reserved(device)
    runner.capture_cuda_graphs(sizes, max_model_len, config.max_num_seqs)
    rows = row_graph_sizes(config)
    if rows:
        runner.capture_row_graphs(rows, config.num_speculative_tokens + 1, max_model_len, config.max_num_seqs)
    if piecewise:
        runner.capture_piecewise_graphs(piecewise)
    if config.mixed_cuda_graph_max_chunk > 0:
        decodes = [b for b in sizes if b <= config.mixed_cuda_graph_max_decodes]
        runner.enable_mixed_graphs(decodes, config.mixed_cuda_graph_max_chunk, max_model_len, config.mixed_cuda_graph_max_graphs,
                                   capture_lock, list(config.piecewise_cuda_graph_sizes))  # fmt: skip
        runner.mixed.capture_at_start(config.mixed_cuda_graph_start_chunk)
    memory.record("cuda_graphs (pool)", torch.cuda.memory_reserved(device) - before)

