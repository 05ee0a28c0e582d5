"""A linear layer that multiplies with a packed copy of its weight on the CPU.

* Sonar's skinny-matmul kernel (``sonar_core/cpu_kernels/csrc/skinny_linear.cpp``), for float32
  and bfloat16. At decode and verification sizes a projection reads its whole weight for a few
  rows, so its speed is the memory's: the kernel streams a weight packed for it at close to the
  read bandwidth (1.4-3x the library matmuls at 1-8 rows, docs/performance.md), gives each row the
  same bits whatever else is in the batch, and on AMX CPUs stays ahead of oneDNN up to prefill
  sizes. Beyond its row limit (:data:`SKINNY_ROWS`) ``F.linear`` runs on the dense weight.
* Otherwise, for bf16/fp16 weights, oneDNN's blocked layout: ``F.linear`` would hand oneDNN the
  plain layout on every call, and re-blocking it costs as much as the multiply at decode sizes.

:func:`prepack_linears` makes the copy this machine can use. The dense weight stays as the
parameter (weight loading, sharing the LM head with proposers and state dicts keep working), so a
packed model holds its projection weights twice. Any device or dtype move of the module drops the
packed copy, and a weight changed in place is packed again on its next use.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core import cpu_kernels
from sonar_core.layers import parameter_epoch
from sonar_core.layers.tensor_parallel import TensorParallel
from sonar_core.layers.tensor_parallel import current as current_tensor_parallel

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


def cpu_prepack_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can pack ``dtype`` weights for oneDNN on this CPU."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    # oneDNN reorders a weight only where the CPU converts that dtype in hardware (bf16: AVX-512;
    # fp16: AVX-512 FP16 or AVX-NE-CONVERT); on an AVX2-only CPU the fp16 reorder raises.
    supported = ops._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else ops._is_mkldnn_fp16_supported
    return bool(supported())


# The most rows for which the skinny kernel stays ahead of the library's matmul, by the code path
# it takes (``skinny_linear_path``), measured side by side with
# `python -m sonar_core.models.linear_benchmark` (docs/performance.md): AMX tiles led oneDNN up to
# 512 rows, float32 on AVX-512 led MKL up to 64, and float32 on AVX2 led MKL up to 80 (AMD EPYC, 2
# threads, a whole prefill step of the embedded model with each limit alternated in one process:
# 1.55x at 33 rows, 1.01-1.24x at 40-80, 0.93-1.04x at 96, 0.92-1.00x at 128). The portable C++
# loops are not used.
SKINNY_ROWS = {"amx": 512, "avx512": 64, "avx2": 80, "generic": 0}
# Paths where the kernel takes bfloat16 calls of any size, prefill included. On an AVX2 CPU the
# library converts bfloat16 in software and was 7-9x slower than the kernel from 8 to 256 rows
# (AMD EPYC, SmolLM2's projections; at 256 rows the kernel's bfloat16 matched MKL's float32). The
# AVX512-BF16 path runs only where AMX is not (with AMX the "amx" path takes bfloat16), and there
# oneDNN has the same dot instruction: on an AMD EPYC with AVX-512 BF16 (2 threads, SmolLM2's 120
# projections, ms a pass) the kernel took 63.6 / 105.3 / 245.8 / 497.8 / 1,005 at 128 / 214 / 512 /
# 1,024 / 2,048 rows against oneDNN's packed weights' 69.8 / 106.5 / 248.5 / 502.7 / 1,008 and
# ``F.linear``'s 85.8 / 117.7 / 263.7 / 556.6 / 1,098.
WHOLE_BF16_PATHS = frozenset({"avx2", "avx512_bf16"})


def skinny_linear_path(dtype: torch.dtype) -> str | None:
    """The code path of the skinny kernel for ``dtype`` on this CPU (``amx``, ``avx512``, ...), or
    None where the kernel does not multiply that dtype (not built, or not one it packs)."""
    ops = cpu_kernels.load() if dtype in cpu_kernels.SKINNY_DTYPES else None
    return ops.skinny_linear_path(dtype) if ops is not None else None


def extra_rows_cost_little(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a matmul of a few more rows (a verification step's drafts, draft branches) costs
    next to what one row costs: on accelerators, and on CPUs whose skinny kernel multiplies
    ``dtype`` on AMX tiles. Elsewhere on the CPU every row adds its multiply-adds, and a
    verification step of six rows measured 1.3-1.5 decode steps (docs/performance.md)."""
    return device.type != "cpu" or skinny_linear_path(dtype) == "amx"


def skinny_rows_limit(dtype: torch.dtype) -> int:
    """The most rows for which :class:`Linear` takes the skinny kernel on this CPU (0: never)."""
    path = skinny_linear_path(dtype)
    if path is None:
        return 0
    if dtype == torch.bfloat16 and path in WHOLE_BF16_PATHS:
        return sys.maxsize
    return SKINNY_ROWS.get(path, 0)


class Linear(nn.Linear):
    """``nn.Linear`` that multiplies with the packed copies :meth:`pack` made of its weight.

    The packed copies follow the weight: one changed in place since (its version counter moved,
    or its storage was swapped) is packed again on the next call, and while autograd records the
    weight (training) the dense path runs, since the kernels have no backward.
    """

    packed_weight: torch.Tensor | None = None  # oneDNN's blocked layout
    skinny_weight: torch.Tensor | None = None  # the skinny kernel's layout
    skinny_rows: int = 0  # the most rows for which the skinny kernel is used
    packed_from: tuple[int, int] | None = None  # the weight's (storage, version) when packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.multiply(x, self.bias)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``: an LM head's logits. Where the skinny kernel takes ``x`` it writes
        the float32 values itself, each rounded to ``x``'s dtype as the output would be, without
        that output and the pass that casts it (about 70 us for four rows of a 49k vocabulary)."""
        return self.multiply(x, self.bias, float_out=True)

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False) -> torch.Tensor:
        """``x @ weight.T + bias`` by the fastest path this layer was packed for (as float32 values
        rounded to ``x``'s dtype with ``float_out``)."""
        out = self._product(x, bias, float_out)
        return out.float() if float_out else out  # a no-op where the kernel wrote float32

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool) -> torch.Tensor:
        if self.packed_from is None or (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self.weight, bias)
        skinny = self.skinny_for(x.numel() // self.in_features, x.dtype)
        ops = None if skinny is None else cpu_kernels.for_tensor(x)
        if ops is not None:
            out = ops.skinny_linear(x.reshape(-1, self.in_features), skinny, bias, self.out_features, float_out)
            return out.view(*x.shape[:-1], self.out_features)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def skinny_for(self, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The packed weight the skinny kernel multiplies ``rows`` rows of ``dtype`` with, or None
        where this layer takes another path. A weight changed in place since it was packed is
        packed again first. For a packed layer outside autograd (:meth:`multiply` checks that)."""
        if self.packed_from is None:
            return None
        if not self._weight_unchanged():
            self.pack()
        skinny = self.skinny_weight
        if skinny is None or skinny.dtype != dtype or rows > self.skinny_rows:
            return None
        return skinny

    def packs_current(self, skinny: torch.Tensor) -> bool:
        """Whether ``skinny`` (an earlier :meth:`skinny_for` answer) is still this layer's packed
        copy of its current weight: nothing repacked it and the weight did not change since. For
        callers that keep the answer across calls instead of asking again."""
        return self.skinny_weight is skinny and self._weight_unchanged()

    def _weight_unchanged(self) -> bool:
        """Whether the weight is the one the packed copies were made from (``_parameters``: the
        attribute lookup of ``nn.Module`` costs more than the check on the decode path)."""
        return self.packed_from == _identity(self._parameters["weight"])

    def pack(self) -> bool:
        """Make the packed copy this machine can use of a CPU weight: the skinny kernel's
        (:func:`pack_skinny`) where it takes the weight, else oneDNN's for bf16/fp16; whether one
        was made. Only one, so that a model holds its weights at most twice."""
        self.unpack()
        weight = self.weight.detach()
        if weight.device.type != "cpu":
            return False
        self.skinny_weight, self.skinny_rows = pack_skinny(weight)
        if self.skinny_weight is None and cpu_prepack_available(weight.dtype):
            # The batch-size hint only tunes the blocking; 1 suits decode, and larger inputs stay fast.
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        if self.skinny_weight is None and self.packed_weight is None:
            return False
        self.packed_from = _identity(self.weight)
        return True

    def unpack(self) -> None:
        """Forget the packed copies (the dense weight serves alone)."""
        self.packed_weight = self.skinny_weight = self.packed_from = None
        parameter_epoch.advance()  # kernel arguments kept elsewhere may hold the dropped copy

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        # A moved or cast weight invalidates the packed copies.
        self.unpack()
        return super()._apply(fn, recurse)


def _identity(weight: torch.Tensor) -> tuple[int, int]:
    """What tells a weight changed since it was packed: its storage and its in-place version
    (tensors made under ``torch.inference_mode`` keep no version; only their storage tells). The
    kernels' ``tensor_stamps`` stamp a whole model's weights by the same rule."""
    return weight.data_ptr(), -1 if weight.is_inference() else weight._version


class RowParallelLinear(Linear):
    """A projection whose input features are split over tensor-parallel ranks (attention output,
    MLP down): each rank multiplies its columns, one all-reduce sums the partial outputs, and the
    bias (whole on every rank) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.parallel.all_reduce(self.multiply(x, None))
        return out if self.bias is None else out + self.bias

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        # The partial outputs are summed in the model's dtype, as forward does, before the cast.
        return self(x).float()


def output_projection(in_features: int, out_features: int, bias: bool) -> Linear:
    """The layer's projection back to the residual stream: row-parallel when the model is being
    built split over ranks (:func:`sonar_core.layers.tensor_parallel.current`), a plain :class:`Linear`
    otherwise (``in_features`` is this rank's share either way)."""
    parallel = current_tensor_parallel()
    if parallel.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, parallel)


def prepack_linears(module: nn.Module) -> int:
    """:meth:`Linear.pack` every :class:`Linear` in ``module``; returns how many got a packed copy
    (0 when the platform offers no packing)."""
    return sum(layer.pack() for layer in module.modules() if isinstance(layer, Linear))


def pack_skinny(weight: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """``weight`` in the skinny kernel's layout and the most rows to use it for, or ``(None, 0)``
    where the kernel is not built or does not take this weight."""
    ops = cpu_kernels.for_tensor(weight)  # None where the kernels are off, as in cpu_kernels.disabled()
    rows = skinny_rows_limit(weight.dtype) if ops is not None else 0
    if not rows or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2):
        return None, 0
    return ops.pack_linear_weight(weight), rows


def drop_prepacked(module: nn.Module) -> None:
    """Forget every packed weight (before the dense weights change)."""
    for layer in module.modules():
        if isinstance(layer, Linear):
            layer.unpack()
