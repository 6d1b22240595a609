"""FP8 weights (W8A8 e4m3) on CUDA: half the bytes of bf16 for every projection of a layer.

Batch-1 decode reads every weight once a token, so bytes are its speed; prefill and large
batches are bound by matmul rate, which Hopper doubles in FP8. Each projection of a layer
(q|k|v, o_proj, gate|up, down_proj) becomes an :class:`Fp8Linear`:

- the weight in ``float8_e4m3fn`` with one float32 scale per output channel (row), chosen so
  that the row's largest magnitude maps to e4m3's largest finite value (448): w ~ q * scale;
- steps of many rows quantize the activations per token on the fly (dynamic scales, the same
  rule per row of x) and multiply on FP8 tensor cores (``torch._scaled_mm``, float32 scales of
  shape [rows, 1] and [1, N], bf16 out);
- steps of one row (batch-1 decode) take the Triton GEMV with the FP8 weight
  (engine/kernels/linear.py, ``w_scale``): it converts each weight tile to bf16 in registers and
  applies the scales in its epilogue, so the activations stay bf16 (W8A16, no activation error).

The embedding and the norms stay bf16. So does the lm_head unless ``EngineConfig.lm_head_quantization``
asks for it in e4m3 (:func:`quantize_lm_head_fp8`): the 8B's head is 1 GB of bf16, an eighth of
what an FP8 step reads, but its rounding moves every logit, so it is a choice with its own measured cost.

Without FP8 hardware (the CPU) the same rounding is emulated in float32, W8A8 in every step (the
stricter case): slower than no quantization, it exists to measure what FP8 costs in answers
(``python -m assistant.eval --quantization fp8 none``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.kernels.row_quant import can_quantize_rows, quantize_rows_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` multiplies FP8 on tensor cores (compute capability 8.9: Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (e4m3 [N, K], float32 scales [N]) with w ~ q * scale per row."""
    amax = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.squeeze(1)


class Fp8Linear(nn.Module):
    """y = x @ W^T (+ bias) with W in e4m3 and per-output-channel scales (see the module doc)."""

    def __init__(self, linear: nn.Module) -> None:
        """``linear``: anything with a ``weight`` [N, K] and a ``bias`` (None or [N]): an nn.Linear,
        or the nn.Embedding a tied head reads (no bias)."""
        super().__init__()
        weight = linear.weight.detach()
        out_features, in_features = weight.shape
        if weight.is_cuda and (in_features % 16 or out_features % 16):
            raise ValueError(f"FP8 matmuls need dims that are multiples of 16, not a [{out_features}, {in_features}] weight")
        q, scale = quantize_rows(weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = in_features, out_features
        self._widened: torch.Tensor | None = None  # the CPU's float32 copy of the rounded weight (emulation only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        # one fused kernel on CUDA (engine/kernels/row_quant.py), the torch rule elsewhere
        xq, x_scale = quantize_rows_triton(rows, FP8_MAX) if x.is_cuda and can_quantize_rows(rows) else quantize_rows(rows)
        if x.device.type == "cuda":
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale[:, None], scale_b=self.weight_scale[None, :], out_dtype=x.dtype)
        else:  # the CPU emulates it: both operands rounded to e4m3, products in float32 (the weight widened once)
            if self._widened is None:
                self._widened = self.dequantized()
            y = ((xq.float() * x_scale[:, None]) @ self._widened.t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight as the GEMV and the matmul see it, in float32 [N, K]."""
        return self.weight.float() * self.weight_scale[:, None]


def replace_projections(model: nn.Module, make: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every layer projection (``PROJECTIONS``) of ``model`` (a LlamaForCausalLM) by
    ``make(projection)``, freeing each old weight as it goes; returns how many were replaced."""
    replaced = 0
    for layer in model.layers:
        for path in PROJECTIONS:
            parent_name, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, name, make(getattr(parent, name)))
            replaced += 1
    return replaced


def quantize_model_fp8(model: nn.Module) -> int:
    """Every layer projection of ``model`` as an :class:`Fp8Linear`; returns how many."""
    return replace_projections(model, Fp8Linear)


def quantize_lm_head_fp8(model: nn.Module) -> None:
    """The head of ``model`` (a LlamaForCausalLM) as an :class:`Fp8Linear`. A head tied to the
    embedding gets an e4m3 copy of its own (the bf16 table stays for the token lookups); an untied
    one is replaced, its bf16 weight freed."""
    model.lm_head = Fp8Linear(model.embed_tokens if model.lm_head is None else model.lm_head)


def weight_scale(linear: nn.Module) -> torch.Tensor | None:
    """An :class:`Fp8Linear`'s per-row scales (the GEMV's ``w_scale``), None for a plain one."""
    return linear.weight_scale if isinstance(linear, Fp8Linear) else None

