"""Planning on the meta device: ``scaled_dot_product_attention`` as the fused kernel the target runs.

Why: SDPA picks its kernel per device, and the meta device has no choice to make, so it decomposes
into the math path. A Llama-7B-shaped model planned on meta (bf16, s=4096) then kept each layer's
``[1, 32, 4096, 4096]`` fp32 attention probabilities (2 GiB a layer, even at ``memory_budget=0.0``) —
a tensor that never exists on the devices that train such a model. So, before AOTAutograd traces a
meta graph, each SDPA call of the Dynamo graph is pointed at the fused op the target would run
(``Options.target_device``), all of which have meta kernels: the plan then keeps the kernel's output
and logsumexp, and can recompute the call.

The choice follows torch's own rules where they matter to memory: on the CPU, the flash kernel
unless dropout is on (then the math path, left as it is); on CUDA, flash for fp16/bf16 without a mask
and head dims up to 256, else memory-efficient attention (grouped-query K/V repeated to the query's
heads first, as the math and efficient paths do). No cuDNN, no GPU-architecture limits.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


def fuse_attention_for(gm: fx.GraphModule, target: str) -> int:
    """Point every SDPA call of ``gm`` at the target's fused kernel; the number of calls changed."""
    fused = {"cpu": _sdpa_on_cpu, "cuda": _sdpa_on_cuda}[target]
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SDPA]
    for node in calls:
        node.target = fused
    if calls:
        gm.recompile()
    return len(calls)


def runs_math_path(query, key, value, dropout_p: float, device: str | None = None) -> bool:
    """Whether SDPA runs torch's math path for these operands on ``device`` (default: theirs), which
    materialises the probabilities ``[b, heads, L, S]``: on the CPU with dropout (the CPU flash kernel
    has none) or head dims that differ; on CUDA (as planned here) a fused kernel."""
    same_dims = query.shape[-1] == key.shape[-1] == value.shape[-1]
    return (device or query.device.type) == "cpu" and (dropout_p > 0 or not same_dims)


def _sdpa_on_cpu(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if runs_math_path(query, key, value, dropout_p, "cpu"):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    key, value = _repeat_kv(query, key, value)
    return aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def _sdpa_on_cuda(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    key, value = _repeat_kv(query, key, value)
    flash = (
        attn_mask is None
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
        and query.shape[-1] <= 256
    )
    if flash:
        return aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


def _repeat_kv(query, key, value):
    """Grouped-query attention: K and V repeated to the query's heads (``enable_gqa``'s math)."""
    groups = query.shape[-3] // key.shape[-3]
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
    return key, value
