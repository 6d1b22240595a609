"""INT4 weights for CUDA (engine/w4a16.py), the parts that run without a GPU: taking a GGUF's own
4-bit groups instead of rounding its dequantized weights a second time. The kernels' tests are in
test_triton_kernels.py (CUDA, or Triton's interpreter)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine import EngineConfig
from engine.fp8 import PROJECTIONS
from engine.gguf_blocks import BlockCache
from engine.loaded_model import LoadedModel
from engine.quantization import gguf_tensors
from engine.w4a16 import W4A16Linear, quantize_model_int4_from_gguf


def test_a_q4_1_gguf_becomes_int4_with_the_files_own_groups(llm_gguf_path):
    """SmolLM2 (llama, every projection Q4_1): all 4 x 30 projections become W4A16 with groups of
    32 whose weights are exactly the dense loader's (the file's fp16 scales and minimums kept as
    they are; llama's Q/K rows un-interleaved like the loader's), and a product through the
    layout equals the dense one."""
    loaded = LoadedModel.load(EngineConfig(model=str(llm_gguf_path), device="cpu", dtype="float32"))
    dense = {(i, p): layer.get_submodule(p).weight.detach().clone() for i, layer in enumerate(loaded.model.layers) for p in PROJECTIONS}
    replaced, kept = quantize_model_int4_from_gguf(loaded.model, BlockCache(gguf_tensors(str(llm_gguf_path))))
    assert (replaced, kept) == (4 * len(loaded.model.layers), 0)
    for (i, path), weight in dense.items():
        module = loaded.model.layers[i].get_submodule(path)
        assert isinstance(module, W4A16Linear) and module.group == 32
        assert torch.equal(module.dequantized(), weight), (i, path)
    x = torch.randn(3, dense[0, "mlp.down_proj"].shape[1])
    torch.testing.assert_close(loaded.model.layers[0].mlp.down_proj(x), F.linear(x, dense[0, "mlp.down_proj"]), rtol=1e-4, atol=1e-4)


def test_projections_with_wider_gguf_types_stay_dense(qwen_0_5b_gguf):
    """Qwen2.5-0.5B's first three layers: only layer 2's down_proj is Q4_K (repacked into groups
    of 32 exactly; its scales rounded to fp16), the rest Q5_0, Q6_K or Q8_0, which stay dense;
    Qwen2's q|k|v bias stays with its (dense) projection."""
    from dataclasses import replace

    from engine.loader import read_gguf
    from engine.model.llama import LlamaDecoderLayer

    config, _ = read_gguf(qwen_0_5b_gguf)
    config = replace(config, num_hidden_layers=3)

    class FirstLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(3))

    model = FirstLayers()
    blocks = BlockCache(gguf_tensors(str(qwen_0_5b_gguf)))
    assert quantize_model_int4_from_gguf(model, blocks) == (1, 11)
    down = model.layers[2].mlp.down_proj
    assert isinstance(down, W4A16Linear) and isinstance(model.layers[2].self_attn.qkv_proj, nn.Linear)
    assert model.layers[2].self_attn.qkv_proj.bias is not None
    want = blocks["blk.2.ffn_down.weight"].dequantize()
    got = down.dequantized().numpy()
    assert np.abs(got - want).max() <= 2**-10 * np.abs(want).max()
