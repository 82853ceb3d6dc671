"""fp32 linear layers on a CPU as oneDNN products: frozen ones (a target, an evaluated draft) over prepacked weights,
trainable ones with oneDNN's backward products too.

Why: torch multiplies fp32 matrices on an x86 CPU with MKL, which is tuned for Intel's; on the AMD CPU we build on it
runs at a third to a half of what oneDNN (torch's `mkldnn` backend, the one its bf16 products and inductor's frozen
CPU graphs already use) gets from the same cores. Measured on a 2-core AMD EPYC (Zen 5, AVX-512), 2 threads:
a 2048^3 product 153-200 GFLOP/s with MKL against 430-460 with oneDNN; SmolLM2's 49,152 x 576 vocabulary head over
the 7 rows of a drafted block 11.5-23 ms against 3-6 ms; a decoder layer's 1536 x 576 projection of 8 rows 160 us
against 54 us. Results agree to fp32 rounding (~1e-4 on logits of magnitude ~20).

Only frozen weights (requires_grad False) are packed; a packed copy costs as much memory as its weight and is
refreshed when the weight is changed in place (a checkpoint loaded after packing). Under autocast, and for other
dtypes and devices, torch's own products run. `DRAFTSMITH_ONEDNN=0` turns it all off.
"""

from __future__ import annotations

import functools
import os
import types
import weakref

import torch
import torch.nn.functional as F

# id(weight) -> (weakref to the weight, its _version when packed, the packed copy). Kept beside the modules, not in
# them: a packed (opaque) tensor cannot be deep-copied, saved or moved like a parameter.
_PACKED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


@functools.cache  # a property of the torch build: asked on every product, answered once
def available() -> bool:
    """Whether this torch build has oneDNN's linear product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def enabled() -> bool:
    return os.environ.get("DRAFTSMITH_ONEDNN", "1") != "0" and available()


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and not weight.requires_grad)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)

    def forget(ref, key=key):
        if key in _PACKED and _PACKED[key][0] is ref:
            del _PACKED[key]

    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)  # 8 rows: a verify's or a block's
    _PACKED[key] = (weakref.ref(weight, forget), weight._version, packed)
    return packed


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a weight that `pack_linears` took in (refreshed if the weight changed), else None."""
    entry = _PACKED.get(id(weight))
    if entry is None or entry[0]() is not weight or not _packable(weight):
        return None
    return entry[2] if entry[1] == weight._version else _pack(weight)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by oneDNN, unconditionally; weight plain [out, in] or packed."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _TrainableLinear(torch.autograd.Function):
    """F.linear with its forward and both backward products by oneDNN, for fp32 weights that train."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad2d, x2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # grad @ W = linear(grad, W.T)
            grad_x = product(grad2d, weight.t().contiguous()).reshape(x.shape)
        if ctx.needs_input_grad[1]:  # grad.T @ x = linear(grad.T, x.T)
            grad_w = product(grad2d.t().contiguous(), x2d.t().contiguous())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2d.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` by oneDNN for fp32 CPU tensors outside autocast: over the packed copy when `weight`
    was packed, with oneDNN's backward products when a gradient is wanted. None elsewhere, or when turned off: the
    caller computes it its own way."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or torch.is_autocast_enabled("cpu") or not enabled()):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _TrainableLinear.apply(x, weight, bias)
    packed = packed_weight(weight)
    return product(x, weight if packed is None else packed, bias)


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, by oneDNN where `linear` can."""
    out = linear(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return fast_linear(x, self.weight, self.bias)


def pack_linears(model: torch.nn.Module, prepack: bool = True) -> int:
    """Run the fp32 CPU `nn.Linear`s of `model` as oneDNN products: frozen weights prepacked (tied ones once; not with
    prepack=False, for a model that trains and never infers), trainable ones with oneDNN's backward too. Returns how
    many; a no-op where oneDNN is unavailable or turned off."""
    if not enabled():
        return 0
    count = 0
    for module in model.modules():
        weight = module.weight if type(module) is torch.nn.Linear else None
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        if prepack and _packable(weight) and packed_weight(weight) is None:
            _pack(weight)
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count


def unpack_linears(model: torch.nn.Module) -> int:
    """Undo `pack_linears` (for side-by-side benchmarks); returns how many modules it restored."""
    count = 0
    for module in model.modules():
        if "forward" in module.__dict__ and getattr(module.forward, "__func__", None) is _forward:
            del module.forward
            _PACKED.pop(id(module.weight), None)
            count += 1
    return count
