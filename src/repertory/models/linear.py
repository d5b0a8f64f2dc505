"""Linear layers through oneDNN on the CPU, for sampling and for the learner, and reduced-precision sampling.

PyTorch runs float32 ``nn.Linear`` on the CPU through MKL's sgemm. MKL picks its kernels by CPU vendor and takes its
AVX2 path on AMD processors: on this project's 2-core AMD EPYC (Zen 4, Genoa: AVX-512 with AVX512_BF16, no AMX) it
sustains about 150 GFLOP/s where oneDNN's kernel, which ships inside PyTorch too, sustains 330-370 — forward, input-
gradient and weight-gradient products alike. At decode sizes the gap is the same (SmolLM2-135M's linear layers at 10
rows: 50 ms a step against 27 ms). :class:`FastLinear` is an ``nn.Linear`` (same parameters, state dict and PEFT
wrapping) whose float32 CPU products, and their gradients, go through oneDNN; on other devices and dtypes it is
``nn.Linear``. Every model repertory loads or builds on a CPU uses it (:func:`use_fast_linears`). The two kernels
agree to float32 rounding (about 1e-6 relative), not bit for bit.

:func:`sampling_precision` is the reduced-precision path for sampling (docs/design.md, Rollouts): under
it, without gradients, each FastLinear multiplies by a bfloat16 copy of its weight (made once per weight
version) and returns float32, so norms, attention, the key/value cache and the softmax stay in float32. It
halves the bytes every decode step reads; SmolLM2-135M's linear layers at 10 rows take 19 ms against 27 ms.
:func:`learner_precision` does the same in the learner for the layers whose weights are frozen (a LoRA run's
base), gradients to their inputs included, so that sampler and learner run one precision
(``model.precision``, :func:`resolve_precision`); trained weights stay float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

PRECISIONS = ("float32", "bfloat16")
"""The precisions sampling may run its linear layers in (``rollout.engine_args.precision``, hf)."""

_SAMPLING_DTYPE: ContextVar[torch.dtype | None] = ContextVar("repertory_sampling_dtype", default=None)
_LEARNER_DTYPE: ContextVar[torch.dtype | None] = ContextVar("repertory_learner_dtype", default=None)


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_ONEDNN_BF16 = _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
"""Whether oneDNN multiplies bfloat16 here: not on a CPU without AVX-512 (its bfloat16 products fail to build)."""


def onednn_available() -> bool:
    """Whether this PyTorch build can run linear products through oneDNN on the CPU."""
    return _ONEDNN


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for any leading shape of ``x`` (strided views of ``weight`` are fine)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _OneDNNLinear(torch.autograd.Function):
    """A linear product of a 2-D input whose forward and both gradient products run through oneDNN. Callers
    reshape outside it: a view made inside a custom Function may not be modified in place (PEFT's mixed-adapter
    LoRA adds each adapter's rows into the base layer's output in place)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = _onednn(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
        grad_w = _onednn(grad.t(), x.t(), None) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class _ReducedFrozenLinear(torch.autograd.Function):
    """A linear product of a 2-D float32 input by a frozen weight's reduced-precision copy, float32 out; the
    input's gradient goes through the same copy (a frozen weight takes none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight)
        return torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "").float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        return _onednn(grad.to(weight.dtype), weight.t(), None).float(), None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear``, through oneDNN for float32 on a CPU (differentiable)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or not _ONEDNN:
        return torch.nn.functional.linear(x, weight, bias)
    tracked = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and tracked and x.dim() == 2:  # no view of the output (FSDP hooks outputs)
        return _OneDNNLinear.apply(x, weight, bias)
    if torch.is_grad_enabled() and tracked:
        out = _OneDNNLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return _onednn(x, weight, bias)


class FastLinear(torch.nn.Linear):
    """``nn.Linear`` through :func:`linear`; through a bfloat16 weight copy under :func:`sampling_precision`, and
    under :func:`learner_precision` when its weight is frozen."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return linear(x, self.weight, self.bias)
        sampling, learning = _SAMPLING_DTYPE.get(), _LEARNER_DTYPE.get()
        if sampling is not None and not torch.is_grad_enabled():
            return self._reduced_product(x, sampling)
        if learning is not None and not any(p.requires_grad for p in (self.weight, self.bias) if p is not None):
            return self._reduced_product(x, learning)
        return linear(x, self.weight, self.bias)

    def _reduced_product(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x`` times the ``dtype`` copy of the weight, float32 out; differentiable in ``x`` only (the weight is
        frozen wherever a gradient is taken)."""
        weight, bias = self._reduced(dtype)
        if not _ONEDNN_BF16:  # PyTorch's own (slow) bfloat16 product, differentiable in x as it is
            return torch.nn.functional.linear(x.to(dtype), weight, bias).float()
        if torch.is_grad_enabled() and x.requires_grad:
            out = _ReducedFrozenLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        return _onednn(x.to(dtype), weight, bias).float()

    def _reduced(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias in ``dtype``, cast again only when the parameters changed (their version counter
        moves with every in-place update, an optimiser step or a LoRA merge included)."""
        stamp = (dtype, self.weight.data_ptr(), self.weight._version, None if self.bias is None else self.bias._version)
        cached = self.__dict__.get("_reduced_copy")
        if cached is None or cached[0] != stamp:
            bias = None if self.bias is None else self.bias.detach().to(dtype)
            cached = (stamp, self.weight.detach().to(dtype), bias)
            self.__dict__["_reduced_copy"] = cached
        return cached[1], cached[2]


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16 or AMX), so oneDNN's bfloat16 products run
    faster than float32 ones (about 1.85x on the Zen 4 of docs/results.md 13); elsewhere they are emulated."""
    return _ONEDNN and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_precision(requested: str, device: str, lora: bool, sharded: bool, engine: str = "hf") -> str:
    """The precision of a run's frozen linear products (``model.precision``) on ``device``: ``auto`` is bfloat16
    for a LoRA run on one unsharded CPU learner whose CPU multiplies bfloat16 natively and whose sampler is the hf
    ``engine`` (which then samples at the same precision), float32 elsewhere (GPUs run their own dtype, sharded
    weights are gathered in float32, another engine samples in its own); an explicit precision is taken as
    given."""
    if requested != "auto":
        return requested
    native = device == "cpu" and native_bfloat16()
    return "bfloat16" if native and lora and not sharded and engine == "hf" else "float32"


def use_fast_linears(model: torch.nn.Module) -> int:
    """Turn every ``nn.Linear`` of a float32 CPU ``model`` into a :class:`FastLinear` in place (parameters
    untouched); returns how many. Models on other devices or dtypes, or builds without oneDNN, are left as
    they are."""
    if not _ONEDNN:
        return 0
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is torch.nn.Linear and weight.device.type == "cpu" and weight.dtype == torch.float32:
            module.__class__ = FastLinear
            count += 1
    return count


def sampled_weight_bytes(model: torch.nn.Module, precision: str = "float32") -> int:
    """Bytes of weights one sampling pass in ``precision`` reads: FastLinear weights in that precision, every other
    parameter in its own dtype, tied weights once."""
    reduced = getattr(torch, precision).itemsize
    sizes = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, FastLinear):
            sizes[id(module.weight)] = module.weight.numel() * reduced
    return sum(sizes.values())


def free_reduced_copies(model: torch.nn.Module) -> None:
    """Drop the reduced-precision weight copies sampling made (they are rebuilt on the next use)."""
    for module in model.modules():
        module.__dict__.pop("_reduced_copy", None)


@contextlib.contextmanager
def _precision(var: ContextVar[torch.dtype | None], precision: str) -> Iterator[None]:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    token = var.set(None if precision == "float32" else getattr(torch, precision))
    try:
        yield
    finally:
        var.reset(token)


def sampling_precision(precision: str) -> contextlib.AbstractContextManager[None]:
    """Run FastLinear layers in ``precision`` (one of :data:`PRECISIONS`) inside the block, without gradients."""
    return _precision(_SAMPLING_DTYPE, precision)


def learner_precision(precision: str) -> contextlib.AbstractContextManager[None]:
    """Run the FastLinear layers whose weights are frozen (a LoRA run's base, a frozen reference) in ``precision``
    inside the block, gradients to their inputs included; trained weights stay float32, and so do their
    products, the optimiser state and everything outside linear layers."""
    return _precision(_LEARNER_DTYPE, precision)
