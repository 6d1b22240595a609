"""The Whisper encoder replayed from CUDA graphs, one per batch-size bucket.

The encoder's input is always 30 s windows of log-mel frames, so its shapes depend only on how
many windows a batch holds. Eagerly, one batch is hundreds of kernel launches, each a PyTorch
call that releases and retakes the GIL; in a server whose other threads (the engine's loop, the
TTS workers, the audio front end) keep the GIL busy, each retake can wait a whole switch interval
(5 ms), and an encoder batch that the GPU runs in tens of milliseconds takes hundreds. A replay is
one call. Batches are padded with zero windows up to the next bucket (1, 2, 4, ... max_batch): at
most twice the rows, each row's output unchanged (the encoder has no cross-row operation).
"""

from __future__ import annotations

import torch

from speech.asr.greedy_decode import batch_buckets
from speech.asr.log_mel import WINDOW_FRAMES
from speech.asr.whisper_model import Whisper


class EncoderGraphs:
    """Encodes up to ``max_batch`` windows a call; from CUDA graphs when ``enabled`` on a GPU,
    else eagerly (the CPU, and the A/B baseline)."""

    def __init__(self, model: Whisper, max_batch: int, enabled: bool, stream: torch.cuda.Stream | None = None) -> None:
        self.model = model
        self.max_batch = max_batch
        weight = model.encoder.conv1.weight
        self.device = weight.device
        self.enabled = enabled and self.device.type == "cuda"
        self.stream = stream
        self.buckets = batch_buckets(max_batch)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._input: torch.Tensor | None = None
        self._output: dict[int, torch.Tensor] = {}
        if self.enabled:
            dims = model.dims
            self._input = torch.zeros(max_batch, dims.n_mels, WINDOW_FRAMES, dtype=weight.dtype, device=self.device)

    def capture(self) -> None:
        """Capture every bucket (largest first, so the smaller ones reuse its memory pool)."""
        if not self.enabled or self._graphs:
            return
        assert self._input is not None
        side = self.stream or torch.cuda.Stream()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for batch in sorted(self.buckets, reverse=True):
                mel = self._input[:batch]
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.model.encode(mel)  # warm-up: kernels chosen and workspaces sized outside the capture
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: other threads of the process (the LLM engine) may use CUDA meanwhile
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    self._output[batch] = self.model.encode(mel)
                self._graphs[batch] = graph
        torch.cuda.synchronize(self.device)

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """(windows <= max_batch, n_mels, 3000) -> (windows, audio_ctx, dim), a new tensor."""
        count = len(mel)
        if count > self.max_batch:
            raise ValueError(f"{count} windows in one encoder call; at most {self.max_batch}")
        if not self._graphs:
            return self.model.encode(mel)
        assert self._input is not None
        batch = next(b for b in self.buckets if b >= count)
        self._input[:count].copy_(mel)
        self._input[count:batch].zero_()
        self._graphs[batch].replay()
        return self._output[batch][:count].clone()  # the static output is overwritten by the next replay

    @property
    def nbytes(self) -> int:
        """The static input and the captured outputs (the graphs' other memory is in their pool)."""
        tensors = ([self._input] if self._input is not None else []) + list(self._output.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def captured(self) -> int:
        """How many buckets replay from graphs (0: eager)."""
        return len(self._graphs)


__all__ = ["EncoderGraphs"]
