"""Plain decoder layers run as direct calls of Sonar's CPU kernels, without module calls.

Why: a decode step of a small model is about ten kernel calls per layer whose arithmetic waits on
memory, and the module path wraps each in Python (``nn.Module`` calls, attribute lookups, the
checks of which kernel applies, views). Replaying one SmolLM2 decode step (one request, bfloat16,
2 threads) took 23.8 ms through the modules and 18.8 ms as the direct calls below, about what its
matmuls alone took. The layers that qualify (:meth:`DirectLayer.of`: the pre-norm layer of Llama,
Qwen2, Qwen3 and MiMo, SiLU, no output gate, on one rank) take the same kernels with the same
arguments in the same order as their modules would, so the output is the same bits; a
step or layer the kernels do not take (autograd, a dtype or row count they are not built for, a
weight not packed for them) runs its module instead.

Consecutive direct layers without per-head q/k norms run as one call of the ``decoder_layers``
kernel (``csrc/decoder_layers.cpp``), the same kernel calls looped in C++, in steps that attend
in place; the kernel copies the states a hidden-state capture records into its buffer, so a
capture does not split the run. Steps with longer rows (prefill chunks, verification of more
drafts) run the direct layers one by one.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core import cpu_kernels
from sonar_core.kv import KVCache
from sonar_core.layers import parameter_epoch
from sonar_core.layers.attention import AttentionMetadata, PagedAttention, attends_in_place
from sonar_core.layers.decoder import DecoderLayer
from sonar_core.layers.linear import Linear
from sonar_core.layers.norms import RMSNorm


class StateCapture(Protocol):
    """What the layers need of a hidden-state capture (the models' ``HiddenStateCapture``): which
    states it wants (state ``k``: the residual stream after ``k`` layers), its buffer and each
    state's columns there, and a way to record a state itself."""

    buffer: torch.Tensor

    def wants(self, index: int) -> bool: ...

    def columns(self, index: int) -> slice: ...

    def record(self, index: int, hidden: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class DirectLayer:
    """What one plain decoder layer's kernel calls read: its modules and its attention shape. The
    arguments read from the modules are kept (:meth:`kernel_args`) and checked against them at
    each call, so loading or repacking weights needs no rebuild."""

    module: DecoderLayer
    input_norm: RMSNorm
    qkv: Linear
    # Qwen3's per-head norms of q and k (their modules run them, as in the module path).
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o: Linear
    post_norm: RMSNorm
    gate_up: Linear
    down: Linear
    num_heads: int
    qk_heads: int
    qk_rows: int
    num_kv_heads: int
    head_dim: int
    attention: PagedAttention
    # The newest kernel arguments read for each dtype (:meth:`kernel_args`).
    _kernel_args: dict[torch.dtype, LayerKernelArgs] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, layer: Any) -> DirectLayer | None:
        """The direct form of ``layer``, or None for a layer the kernels cannot run alone."""
        return cls.of_modules(layer) if type(layer) is DecoderLayer else None

    @classmethod
    def of_modules(cls, layer: DecoderLayer) -> DirectLayer | None:
        """The kernel form of a decoder layer's modules, whatever its ``forward`` (a subclass that
        wires them differently calls the kernels itself, as EAGLE-3's first draft layer does);
        None where a module is not one the kernels run."""
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (
            attn.output_gate
            or mlp.act is not F.silu
            or any(type(linear) is not Linear for linear in linears)
            or any(type(norm) is not RMSNorm for norm in norms)
        ):
            return None
        return cls(
            module=layer,
            input_norm=layer.input_layernorm,
            qkv=attn.qkv_proj,
            q_norm=attn.q_norm if attn.qk_norm else None,
            k_norm=attn.k_norm if attn.qk_norm else None,
            o=attn.o_proj,
            post_norm=layer.post_attention_layernorm,
            gate_up=mlp.gate_up_proj,
            down=mlp.down_proj,
            num_heads=attn.num_heads,
            qk_heads=attn.qk_heads,
            qk_rows=attn.q_rows + attn.kv_rows,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            attention=attn.attn,
        )

    @property
    def stackable(self) -> bool:
        """Whether the ``decoder_layers`` kernel runs this layer (it has no per-head q/k norms)."""
        return self.q_norm is None

    def kernel_args(self, hidden: torch.Tensor, kv_cache: KVCache) -> LayerKernelArgs | None:
        """What the kernels read for this layer on ``hidden`` (:meth:`packed_weights` and
        :meth:`stack_entries`), or None where a module would not take the kernel. Kept per dtype
        and read again only when a module's tensor or the cache changed: reading them for every
        layer of every step cost about 0.4 ms a SmolLM2 decode step of 8.5 (AMD EPYC, 2 threads)."""
        args = self._kernel_args.get(hidden.dtype)
        if args is not None and hidden.shape[0] <= args.max_rows and args.reads(self, kv_cache):
            return args
        packed = self.packed_weights(hidden, kv_cache)
        if packed is None:
            return None
        args = LayerKernelArgs(
            packed, self.stack_entries(packed, kv_cache), self._packed_rows(), kv_cache, self._tensors(), self._weights()
        )
        self._kernel_args[hidden.dtype] = args
        return args

    def _linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.qkv, self.o, self.gate_up, self.down

    def _weights(self) -> tuple[torch.Tensor, ...]:
        """The four projections' weights as they are now (the tensors their packed copies are of)."""
        return tuple(linear._parameters["weight"] for linear in self._linears())

    def _packed_rows(self) -> int:
        """The most rows for which every projection takes its skinny kernel."""
        return min(linear.skinny_rows for linear in self._linears())

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The module tensors :meth:`stack_entries` reads besides the packed weights, as they are now
        (``_parameters``: the attribute lookup of ``nn.Module`` costs more than the check)."""
        norms = (self.input_norm._parameters["weight"], self.post_norm._parameters["weight"])
        return norms + tuple(linear._parameters["bias"] for linear in self._linears())

    def packed_weights(self, hidden: torch.Tensor, kv_cache: KVCache) -> PackedWeights | None:
        """The packed weights of the four projections when every call of this layer takes the
        kernel for ``hidden``, as its modules would decide; None otherwise."""
        rows, dtype = hidden.shape[0], hidden.dtype
        if not (self.input_norm.weight.dtype == self.post_norm.weight.dtype == kv_cache[0].dtype == dtype):
            return None
        packed = tuple(linear.skinny_for(rows, dtype) for linear in self._linears())
        # Identity tests: ``None in packed`` would compare tensors with None, which costs an exception each.
        return None if any(weight is None for weight in packed) else packed  # type: ignore[return-value]

    def forward(
        self,
        ops: Any,
        packed: PackedWeights,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's output for ``hidden`` ``[T, hidden_size]`` (contiguous); ``packed`` is
        :meth:`packed_weights`' answer, ``cos`` and ``signed_sin`` are the step's rotary tables
        as ``[T, rotary_dim]``."""
        tokens = hidden.shape[0]
        k_cache, v_cache = kv_cache
        qkv_weight, o_weight, gate_up_weight, down_weight = packed
        normed = ops.rms_norm(hidden, self.input_norm.weight, self.input_norm.eps)
        qkv = ops.skinny_linear(normed, qkv_weight, self.qkv.bias, self.qkv.out_features)
        qk = qkv[:, : self.qk_rows].view(tokens, self.qk_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        ops.rotary_embedding_(qk, cos, signed_sin)
        v = qkv[:, self.qk_rows :].view(tokens, self.num_kv_heads, self.head_dim)
        ops.store_kv_(qk[:, self.num_heads :], v, k_cache, v_cache, metadata.slot_mapping)
        attended = self.attention.attend(qk[:, : self.num_heads], kv_cache, metadata)
        out = ops.skinny_linear(attended, o_weight, self.o.bias, self.o.out_features)
        normed, hidden = ops.add_rms_norm(out, hidden, self.post_norm.weight, self.post_norm.eps)
        gate_up = ops.skinny_linear(normed, gate_up_weight, self.gate_up.bias, self.gate_up.out_features)
        down = ops.skinny_linear(ops.silu_and_mul(gate_up), down_weight, self.down.bias, self.down.out_features)
        return hidden + down

    def stack_entries(self, packed: PackedWeights, kv_cache: KVCache) -> StackEntries:
        """This layer's entries in the ``decoder_layers`` kernel's lists (see its source)."""
        qkv_weight, o_weight, gate_up_weight, down_weight = packed
        return (
            [self.input_norm.weight, qkv_weight, o_weight, self.post_norm.weight, gate_up_weight, down_weight],
            [linear.bias for linear in self._linears()],
            list(kv_cache),
            [self.num_heads, self.num_kv_heads, self.head_dim, self.attention.sliding_window or 0]
            + [linear.out_features for linear in self._linears()],
            [self.input_norm.eps, self.post_norm.eps, self.attention.scale],
        )


# The packed weights of a layer's qkv, o, gate_up and down projections.
PackedWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# A layer's share of the decoder_layers kernel's lists: weights, biases, caches, ints, floats.
StackEntries = tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor], list[int], list[float]]


@dataclass(frozen=True)
class LayerKernelArgs:
    """One layer's kernel arguments for one dtype (:meth:`DirectLayer.kernel_args`) and what they
    were read from, so that a later step can tell whether they still hold."""

    packed: PackedWeights
    entries: StackEntries
    max_rows: int  # the most rows the packed weights serve (the projections' skinny limit)
    kv_cache: KVCache
    tensors: tuple[torch.Tensor | None, ...]  # DirectLayer._tensors() when read
    # DirectLayer._weights() when read: the packed copies are of them, so a change in place makes
    # these arguments stale (the norms and biases are read by the kernels as they are).
    weights: tuple[torch.Tensor, ...]

    def reads(self, layer: DirectLayer, kv_cache: KVCache) -> bool:
        """Whether these arguments are still the layer's for ``kv_cache``: the same cache tensors,
        norm weights and biases, and each packed weight its projection's copy of its current weight
        (a weight changed in place is packed again by the read that follows)."""
        return (
            kv_cache[0] is self.kv_cache[0]
            and kv_cache[1] is self.kv_cache[1]
            and all(map(Linear.packs_current, layer._linears(), self.packed))
            and all(map(operator.is_, layer._tensors(), self.tensors))
        )


class KeptArgsCheck:
    """The kernel arguments a model's layers used in the last step that checked them, for as long
    as they still hold: one check a step for the whole model.

    Why: :meth:`LayerKernelArgs.reads` asks each layer's modules for their tensors, about 11 us a
    layer once a step's weights have swept the caches (0.35 ms of a 13 ms SmolLM2 decode step on
    a Xeon with AMX). Here a step compares the caches by identity, :mod:`parameter_epoch` (no
    parameter or packed copy swapped) and, in one kernel call, the stamps of every projection
    weight the packed copies were made from (none changed in place). Where anything differs the
    layers check themselves as before, and what they then use is remembered for the next step.
    """

    def __init__(self) -> None:
        self._used: list[LayerKernelArgs | None] = []
        self._watched: list[torch.Tensor] = []
        self._stamps: torch.Tensor | None = None  # None: nothing to trust
        self._epoch = -1
        self._dtype: torch.dtype | None = None
        self._max_rows = 0

    def current(self, ops: Any, hidden: torch.Tensor, kv_caches: Sequence[KVCache]) -> list[LayerKernelArgs | None] | None:
        """Each layer's remembered arguments (None for a layer without a direct form) where they
        still hold for ``hidden`` and this step's ``kv_caches``; None where the layers must check
        themselves."""
        if (
            self._stamps is None
            or self._epoch != parameter_epoch.current()
            or hidden.dtype != self._dtype
            or hidden.shape[0] > self._max_rows
        ):
            return None
        for args, kv_cache in zip(self._used, kv_caches, strict=True):
            if args is not None and (kv_cache[0] is not args.kv_cache[0] or kv_cache[1] is not args.kv_cache[1]):
                return None
        return self._used if ops.same_stamps(self._watched, self._stamps) else None

    def remember(
        self, ops: Any, direct: Sequence[DirectLayer | None], used: list[LayerKernelArgs | None], dtype: torch.dtype
    ) -> None:
        """Remember the arguments each layer's own check gave this step (``used[i]``: layer i's,
        None where it ran its module). Only a step whose every direct layer took its kernel
        arguments leaves something to trust: a layer that ran its module stays checked by itself."""
        if any(args is None for plan, args in zip(direct, used, strict=True) if plan is not None):
            self._stamps = None
            return
        present = [args for args in used if args is not None]
        self._used = used
        self._watched = [weight for args in present for weight in args.weights]
        self._stamps = ops.tensor_stamps(self._watched)
        self._epoch = parameter_epoch.current()
        self._dtype = dtype
        self._max_rows = min((args.max_rows for args in present), default=0)


def run_stack(
    ops: Any,
    entries: Sequence[StackEntries],
    hidden: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    metadata: AttentionMetadata,
    attention_input: torch.Tensor | None = None,
    capture: StateCapture | None = None,
    captured: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:
    """Consecutive stackable layers (their :meth:`DirectLayer.stack_entries`) in one kernel call;
    with ``attention_input``, the first layer's attention reads it in place of its input norm of
    ``hidden``. ``captured``: ``(k, state)`` pairs, the state after ``k`` layers of the run being
    ``capture``'s state ``state``."""
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    caches: list[torch.Tensor] = []
    ints: list[int] = []
    floats: list[float] = []
    for layer_weights, layer_biases, layer_caches, layer_ints, layer_floats in entries:
        weights += layer_weights
        biases += layer_biases
        caches += layer_caches
        ints += layer_ints
        floats += layer_floats
    copies: tuple[Any, ...] = ()
    if capture is not None and captured:
        copies = (capture.buffer, [after for after, _ in captured], [capture.columns(state).start for _, state in captured])
    return ops.decoder_layers(
        hidden, cos, signed_sin, weights, biases, caches, ints, floats, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, metadata.slot_mapping, metadata.causal, attention_input, *copies,
    )


def run_with_attention_input(
    plan: DirectLayer,
    attention_input: torch.Tensor,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
) -> torch.Tensor | None:
    """``hidden + attn(attention_input)`` then ``h + mlp(norm(h))`` through the modules of ``plan``
    in one kernel call, or None where the kernels do not take this step (the caller then runs the
    modules). ``cos``/``signed_sin``: ``[T, 1, rotary_dim]``."""
    if not plan.stackable or not attention_input.is_contiguous() or attention_input.dtype != hidden.dtype:
        return None
    if not attends_in_place(metadata, hidden.dtype):
        return None
    ops = _kernels_for(hidden)
    args = None if ops is None else plan.kernel_args(hidden, kv_cache)
    if args is None:
        return None
    return run_stack(ops, [args.entries], hidden, *_flat_tables(cos, signed_sin), metadata, attention_input)


def run_layers(
    layers: Sequence[nn.Module],
    direct: Sequence[DirectLayer | None],
    hidden: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_caches: Sequence[KVCache],
    metadata: AttentionMetadata,
    capture: StateCapture | None = None,
    kept_args: KeptArgsCheck | None = None,
) -> torch.Tensor:
    """Run ``layers`` in turn (``direct[i]``: layer i's direct form, or None), each directly where
    the kernels take it and through its module otherwise, consecutive stackable ones in one kernel
    call; ``cos``/``signed_sin`` are the step's ``[T, 1, rotary_dim]`` tables. ``capture`` gets
    the states after the layers it asks for. ``kept_args``: the model's check of its layers' kept
    kernel arguments, kept across steps (without it each layer checks its own)."""
    ops = _kernels_for(hidden)
    trusted = None  # the layers' kernel arguments where kept_args vouches for them this step
    if ops is not None:
        flat_cos, flat_sin = _flat_tables(cos, signed_sin)
        if kept_args is not None:
            trusted = kept_args.current(ops, hidden, kv_caches)
    # The stack kernel attends in place; a step with longer rows runs its layers one by one.
    stacks = attends_in_place(metadata, hidden.dtype)
    stack: list[StackEntries] = []
    captured: list[tuple[int, int]] = []  # the run's states to record: (layers into the run, state)
    used: list[LayerKernelArgs | None] = []  # each layer's kernel arguments this step
    for index, layer in enumerate(layers):
        plan = direct[index]
        args = None
        if ops is not None and plan is not None and plan.module is layer:
            args = trusted[index] if trusted is not None else plan.kernel_args(hidden, kv_caches[index])
        used.append(args)
        wanted = capture is not None and capture.wants(index + 1)
        if args is not None and plan is not None and plan.stackable and stacks:
            stack.append(args.entries)
            if wanted:
                captured.append((len(stack), index + 1))
            if index + 1 < len(layers):
                continue  # the run goes on
            hidden = run_stack(ops, stack, hidden, flat_cos, flat_sin, metadata, None, capture, captured)
            continue
        if stack:
            hidden = run_stack(ops, stack, hidden, flat_cos, flat_sin, metadata, None, capture, captured)
            stack, captured = [], []
        if args is not None and plan is not None:
            hidden = plan.forward(ops, args.packed, hidden, flat_cos, flat_sin, kv_caches[index], metadata)
        else:
            hidden = layer(hidden, cos, signed_sin, kv_caches[index], metadata)
        if capture is not None and wanted:
            capture.record(index + 1, hidden)
    if ops is not None and kept_args is not None and trusted is None:
        kept_args.remember(ops, direct, used, hidden.dtype)
    return hidden


class _Switch:
    """Blocks that run every layer through its modules (:func:`through_modules`)."""

    off = 0


@contextlib.contextmanager
def through_modules() -> Iterator[None]:
    """Run every layer through its modules inside the block (the step benchmark times both)."""
    _Switch.off += 1
    try:
        yield
    finally:
        _Switch.off -= 1


def _flat_tables(cos: torch.Tensor, signed_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's ``[T, 1, rotary_dim]`` rotary tables as the kernels read them, ``[T, rotary_dim]``."""
    tokens = cos.shape[0]
    return cos.reshape(tokens, -1), signed_sin.reshape(tokens, -1)


def _kernels_for(hidden: torch.Tensor) -> Any:
    """The kernels when this step's layers may run directly: inference (no autograd), a
    contiguous ``[T, hidden]`` CPU input of a dtype the matmul kernel packs. Whatever the rows'
    lengths: a row too long to attend in place takes the gathered attention inside a direct
    layer, as it would inside the module (verifying nine rows through the modules cost 2.9
    decode steps against 1.9 for eight rows on an AVX2 EPYC: docs/performance.md)."""
    if _Switch.off or torch.is_grad_enabled() or hidden.dim() != 2 or not hidden.is_contiguous():
        return None
    if hidden.dtype not in cpu_kernels.SKINNY_DTYPES:
        return None
    return cpu_kernels.for_tensor(hidden)
