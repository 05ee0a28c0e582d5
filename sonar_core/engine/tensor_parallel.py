"""Tensor-parallel worker processes, and the driver's handle on them.

The driver (rank 0) is the engine's own process: it schedules, samples, verifies and proposes, and
runs its share of every split model. Ranks 1.. are worker processes that hold their shares and
mirror the driver's forward passes: before each one the driver broadcasts what the step runs on
(token ids, positions, attention metadata, recurrent-state slots), every rank runs its share, and
the all-reduces inside the layers keep them in step. Only the driver computes logits (the LM head
is whole on every rank), so the rejection sampler and the proposer decide once, and every rank
verifies the same tokens because it ran the same inputs.

Everything travels over ``torch.distributed`` (:mod:`sonar_core.layers.tensor_parallel`); a worker that
fails leaves its exception in the rendezvous store, so that the driver's error names the rank and
its exception instead of gloo's "connection closed".
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from sonar_core.config.parallel import cpu_oversubscription_warning, usable_cores
from sonar_core.errors import SonarError
from sonar_core.kv import KVLayerSpec, RecurrentStateCache, StateBatch, StateLayerSpec, allocate_kv_cache
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.tensor_parallel import (
    COMPUTE_TIMEOUT,
    TensorParallel,
    driver_store,
    open_groups,
    tensor_parallel_scope,
    worker_store,
)

logger = logging.getLogger("sonar.parallel")

HOST = "127.0.0.1"
# How long the driver waits for a dying worker to say why, and for workers to exit on close.
DEATH_NOTE_WAIT_S = 5.0
JOIN_TIMEOUT_S = 10.0
# The fields of AttentionMetadata that describe a step (the rest are per-process caches).
_METADATA_FIELDS = tuple(f.name for f in fields(AttentionMetadata) if f.init and f.name != "state")


class TensorParallelError(SonarError, RuntimeError):
    """A tensor-parallel rank failed; the engine cannot go on without it."""


# ------------------------------------------------------------------------------------ commands
@dataclass
class LoadModel:
    """Build and load model ``key`` as this rank's share (``load_model``'s arguments)."""

    key: str
    kwargs: dict[str, Any]


@dataclass
class AllocateKV:
    key: str
    specs: list[KVLayerSpec]
    num_blocks: int
    block_size: int
    dtype: torch.dtype


@dataclass
class AllocateStates:
    key: str
    specs: list[StateLayerSpec]
    num_slots: int
    max_positions: int
    dtype: torch.dtype


@dataclass
class Forward:
    """One forward pass of model ``key``: the step's inputs, on the host."""

    key: str
    input_ids: PackedTensor | None
    inputs_embeds: PackedTensor | None
    positions: PackedTensor
    metadata: dict[str, Any]
    state: tuple[list[int], list[bool], list[int]] | None


@dataclass
class CommitStates:
    key: str
    slots: list[int]
    positions: list[int]


class Shutdown:
    """End the worker loop."""


@dataclass(frozen=True)
class PackedTensor:
    """A tensor as raw bytes: pickling this costs microseconds, pickling a tensor itself about a
    hundred (torch serialises its storage through ``torch.save``), and a step sends about ten."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> PackedTensor:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        return cls(tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy().tobytes())

    def unpack(self, device: torch.device) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype, device=device)
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(self.dtype).reshape(self.shape).to(device)


def _pack(value: Any) -> Any:
    """``value`` with every tensor in it (also inside a dict) packed for the control group."""
    if isinstance(value, torch.Tensor):
        return PackedTensor.of(value)
    if isinstance(value, dict):
        return {k: _pack(v) for k, v in value.items()}
    return value


def _unpack(value: Any, device: torch.device) -> Any:
    """The inverse of :func:`_pack`, onto ``device``."""
    if isinstance(value, PackedTensor):
        return value.unpack(device)
    if isinstance(value, dict):
        return {k: _unpack(v, device) for k, v in value.items()}
    return value


# -------------------------------------------------------------------------------------- worker
def _die_with_parent() -> None:
    """Ask Linux to kill this worker when the driver dies, however it dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _ready_key(rank: int) -> str:
    return f"sonar/ready/{rank}"


def _error_key(rank: int) -> str:
    return f"sonar/error/{rank}"


def worker_main(rank: int, size: int, port: int, device_name: str, threads: int) -> int:
    """A worker process: join the group, then run the driver's commands until told to stop.

    Its exception, if any, is left in the rendezvous store for the driver to report."""
    _die_with_parent()
    store = worker_store(HOST, port)
    try:
        torch.set_num_threads(threads)
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store.set(_ready_key(rank), "1")
        parallel = open_groups(rank, size, store, device)
        _Worker(parallel, device).serve()
    except BaseException as exc:
        traceback.print_exc()
        try:
            store.set(_error_key(rank), f"{type(exc).__name__}: {exc}")
        except Exception:  # the driver is gone: nobody to tell
            pass
        return 1
    return 0


class _Worker:
    """Rank ``parallel.rank``'s models, caches and states, by the driver's keys."""

    def __init__(self, parallel: TensorParallel, device: torch.device) -> None:
        self.parallel = parallel
        self.device = device
        self.models: dict[str, torch.nn.Module] = {}
        self.kv: dict[str, list[Any]] = {}
        self.states: dict[str, RecurrentStateCache] = {}

    def serve(self) -> None:
        while True:
            command = self.parallel.broadcast_object()
            if isinstance(command, Shutdown):
                return
            if isinstance(command, Forward):
                self._forward(command)
            elif isinstance(command, CommitStates):
                self.states[command.key].commit(command.slots, command.positions)
            else:
                self.parallel.gather_objects(_attempt(lambda c=command: self._setup(c)))

    def _setup(self, command: LoadModel | AllocateKV | AllocateStates) -> None:
        if isinstance(command, LoadModel):
            from sonar_core.models.loader import load_model

            with tensor_parallel_scope(self.parallel), torch.inference_mode():
                self.models[command.key] = load_model(**command.kwargs, device=self.device).model
        elif isinstance(command, AllocateKV):
            self.kv[command.key] = allocate_kv_cache(
                command.specs, command.num_blocks, command.block_size, command.dtype, self.device
            )
        else:
            self.states[command.key] = RecurrentStateCache(
                command.specs, command.num_slots, command.max_positions, command.dtype, self.device
            )

    @torch.inference_mode()
    def _forward(self, command: Forward) -> None:
        metadata = AttentionMetadata(**_unpack(command.metadata, self.device))
        if command.state is not None:
            slots, has_initial, keep = command.state
            metadata.state = StateBatch(self.states[command.key], slots, has_initial, keep)
        self.models[command.key](
            _unpack(command.input_ids, self.device),
            _unpack(command.positions, self.device),
            self.kv.get(command.key, []),
            metadata,
            inputs_embeds=_unpack(command.inputs_embeds, self.device),
        )


def _attempt(action: Callable[[], None]) -> str | None:
    """None when ``action`` ran, else its error as one line (reported to the driver)."""
    try:
        action()
    except Exception as exc:
        logger.exception("tensor-parallel setup step failed")
        return f"{type(exc).__name__}: {exc}"
    return None


# -------------------------------------------------------------------------------------- driver
class TensorParallelWorkers:
    """The driver's side: starts ``size - 1`` worker processes and joins their group as rank 0.

    Every method that changes per-rank state (loading, allocating, forward passes, state commits)
    runs on every rank; the driver does its own share in the same call.
    """

    def __init__(self, size: int, device: torch.device, threads_per_rank: int) -> None:
        if device.type == "cuda" and size > torch.cuda.device_count():
            raise TensorParallelError(
                f"tensor_parallel_size={size} needs {size} CUDA devices and {torch.cuda.device_count()} are visible; "
                "lower --tensor-parallel-size or make more devices visible (CUDA_VISIBLE_DEVICES)"
            )
        self.size = size
        self.device = device
        self.dead: str | None = None
        # The models loaded on every rank, by key.
        self.keys: set[str] = set()
        self._store = driver_store(HOST)
        # Workers are fresh interpreters (``python -m``), not forks: a forked torch process can
        # deadlock on threads it copied, and a spawned one would re-run the user's main script.
        self._processes = [
            subprocess.Popen([
                sys.executable, "-m", "sonar_core.engine.tensor_parallel_worker", str(rank), str(size), str(self._store.port),
                f"cuda:{rank}" if device.type == "cuda" else str(device), str(threads_per_rank),
            ])
            for rank in range(1, size)
        ]
        atexit.register(self.close)
        self._wait_until_started()
        try:
            self.parallel = open_groups(0, size, self._store, device)
        except Exception as exc:
            raise self._failure(exc) from None
        logger.info(
            "tensor parallelism: %d ranks on %s (%s), %d thread(s) per rank",
            size, device, "NCCL" if device.type == "cuda" else "gloo", threads_per_rank,
        )

    def _wait_until_started(self) -> None:
        """Wait for every worker to reach the rendezvous, failing fast (not after the store's
        timeout) when one exits first, with its reason."""
        deadline = time.monotonic() + COMPUTE_TIMEOUT.total_seconds()
        waiting = set(range(1, self.size))
        while waiting:
            waiting = {rank for rank in waiting if not self._store.check([_ready_key(rank)])}
            for rank in waiting:
                if self._processes[rank - 1].poll() is not None:
                    self.dead = f"tensor-parallel rank {rank} failed to start: {self._reason(rank)}"
                    self.close()
                    raise TensorParallelError(self.dead)
            if time.monotonic() > deadline:
                self.close()
                raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting)} did not start in time")
            time.sleep(0.02)

    def _reason(self, rank: int) -> str:
        """What rank ``rank`` said before it died, else its exit code."""
        key = _error_key(rank)
        if self._store.check([key]):
            return self._store.get(key).decode()
        return f"exited with code {self._processes[rank - 1].poll()} (its log is above)"

    # ------------------------------------------------------------------------------ setup steps
    def load_model(self, key: str, **kwargs: Any) -> Any:
        """``load_model(**kwargs)`` on every rank, each building its share; returns the driver's
        :class:`~sonar_core.models.loader.LoadedModel`, whose model mirrors each forward pass
        onto the workers. The driver's own error (a bad checkpoint) is raised as it is."""
        from sonar_core.models.loader import load_model, resolve_checkpoint

        kwargs["model"] = resolve_checkpoint(
            kwargs.get("model"), kwargs.pop("revision", None), kwargs.get("trust_remote_code", False),
            kwargs.get("field", "model"),
        )
        # The folder is resolved (downloaded, converted) once, here; every rank loads from it.
        self.send(LoadModel(key, {k: v for k, v in kwargs.items() if k != "device"}))
        self.keys.add(key)
        loaded, error = None, None
        try:
            with tensor_parallel_scope(self.parallel), torch.inference_mode():
                loaded = load_model(**kwargs)
        except Exception as exc:
            error = exc
        self._gather_setup(None if error is None else str(error))
        if error is not None:
            raise error
        loaded.model = mirror_model(loaded.model, key, self)
        return loaded

    def allocate_kv(self, key: str, specs: list[KVLayerSpec], num_blocks: int, block_size: int,
                    dtype: torch.dtype) -> None:
        """The workers' paged caches for model ``key`` (the driver allocates its own)."""
        self.send(AllocateKV(key, specs, num_blocks, block_size, dtype))
        self._gather_setup(None)

    def allocate_states(self, key: str, specs: list[StateLayerSpec], num_slots: int, max_positions: int,
                        dtype: torch.dtype) -> None:
        """The workers' recurrent states for model ``key`` (:class:`MirroredStateCache` calls it)."""
        self.send(AllocateStates(key, specs, num_slots, max_positions, dtype))
        self._gather_setup(None)

    def _gather_setup(self, own_error: str | None) -> None:
        try:
            reports = self.parallel.gather_objects(own_error)
        except Exception as exc:
            raise self._failure(exc) from None
        for rank, report in enumerate(reports):
            if report is not None and rank > 0:
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {report}")

    # ------------------------------------------------------------------------------- per step
    def forward(self, run: Callable[[], torch.Tensor], command: Forward) -> torch.Tensor:
        """Send ``command`` to the workers, then run the driver's share (``run``)."""
        self.send(command)
        try:
            return run()
        except RuntimeError as exc:
            if _is_collective_failure(exc):
                raise self._failure(exc) from None
            raise

    def send(self, command: Any) -> None:
        """Broadcast one command to the workers (refused once a rank has died)."""
        if self.dead is not None:
            raise TensorParallelError(self.dead)
        try:
            self.parallel.broadcast_object(command)
        except Exception as exc:
            raise self._failure(exc) from None

    # ------------------------------------------------------------------------------ failures
    def _failure(self, exc: BaseException) -> TensorParallelError:
        """The error of a collective that failed: the dead rank and its own exception when it
        left one, else the collective's message. The engine is dead from here on."""
        deadline = time.monotonic() + DEATH_NOTE_WAIT_S
        dead: list[int] = []
        while not dead and time.monotonic() < deadline:
            dead = [rank for rank, p in enumerate(self._processes, start=1) if p.poll() is not None]
            time.sleep(0.05)
        if dead:
            self.dead = f"tensor-parallel rank {dead[0]} failed: {self._reason(dead[0])}"
        else:
            self.dead = f"a tensor-parallel collective failed: {exc}"
        self.close()
        return TensorParallelError(self.dead + "; the engine has stopped, restart it")

    def close(self) -> None:
        """Stop every worker (idempotent): a shutdown command, then a wait, then a kill."""
        if not self._processes:
            return
        if self.dead is None and hasattr(self, "parallel"):
            try:
                self.parallel.broadcast_object(Shutdown())
            except Exception:  # a dead group: the workers are killed below anyway
                pass
        self.dead = self.dead or "the tensor-parallel workers were shut down"
        for process in self._processes:
            try:
                process.wait(JOIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(JOIN_TIMEOUT_S)
        self._processes = []
        atexit.unregister(self.close)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._processes]



def _is_collective_failure(exc: RuntimeError) -> bool:
    text = str(exc)
    return "gloo" in text.lower() or "Connection closed" in text or "NCCL" in text or "timed out" in text.lower()


class _Mirroring:
    """Mixed in front of a split model's class on the driver (see :func:`mirror_model`): every
    forward pass is first sent to the workers; every other use (logits, shared modules, KV specs)
    is the driver's share alone. The model keeps its class otherwise, so ``isinstance`` checks
    and attributes work as on one device."""

    mirror_key: str
    mirror_workers: TensorParallelWorkers

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[Any],
        attn_metadata: AttentionMetadata,
        capture: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        state = attn_metadata.state
        command = Forward(
            key=self.mirror_key,
            input_ids=_pack(input_ids),
            inputs_embeds=_pack(inputs_embeds),
            positions=_pack(positions),
            metadata={name: _pack(getattr(attn_metadata, name)) for name in _METADATA_FIELDS},
            state=None if state is None else (state.slots, state.has_initial_state, state.keep_positions),
        )
        own_share = super().forward  # type: ignore[misc]
        return self.mirror_workers.forward(
            lambda: own_share(input_ids, positions, kv_caches, attn_metadata, capture=capture,
                              inputs_embeds=inputs_embeds),
            command,
        )


def mirror_model(model: torch.nn.Module, key: str, workers: TensorParallelWorkers) -> torch.nn.Module:
    """Make the driver's share ``model`` mirror its forward passes onto the workers' model ``key``."""
    cls = type(model)
    model.__class__ = type(f"Mirrored{cls.__name__}", (_Mirroring, cls), {"__module__": cls.__module__})
    model.mirror_key = key
    model.mirror_workers = workers
    return model


class MirroredStateCache(RecurrentStateCache):
    """The driver's recurrent states of model ``key``; the workers allocate theirs alongside, and
    every commit (verification's rollback) runs on every rank."""

    def __init__(self, workers: TensorParallelWorkers, key: str, specs: list[StateLayerSpec], num_slots: int,
                 max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(specs, num_slots, max_positions, dtype, device)
        workers.allocate_states(key, specs, num_slots, max_positions, dtype)
        self._workers = workers
        self._key = key

    def commit(self, slots: list[int], positions: list[int]) -> None:
        if slots:
            self._workers.send(CommitStates(self._key, slots, positions))
        super().commit(slots, positions)


# Keys of the models every rank holds.
TARGET = "target"
DRAFT = "draft"


@dataclass(frozen=True)
class SplitDraftLoader:
    """What a proposer gets to load its draft model split over the target's ranks."""

    workers: TensorParallelWorkers

    def load_model(self, **load_model_arguments: Any) -> Any:
        return self.workers.load_model(DRAFT, **load_model_arguments)


def start_tensor_parallel(size: int, device: torch.device) -> TensorParallelWorkers | None:
    """The workers of a ``size``-way split (None for one device).

    On the CPU the ranks share the machine's cores evenly (at least one thread each): ranks
    that together ran more threads than cores would wait at every all-reduce for a rank the
    system descheduled. The driver's own thread count is set here too.
    """
    if size == 1:
        return None
    threads = 1
    if device.type == "cpu":
        warning = cpu_oversubscription_warning(size)
        if warning:
            logger.warning(warning)
        threads = max(1, usable_cores() // size)
        torch.set_num_threads(threads)
    return TensorParallelWorkers(size, device, threads)
