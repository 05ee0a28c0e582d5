"""This process's place in a tensor-parallel group, and the scope in which models are built split.

A model built inside :func:`tensor_parallel_scope` holds only its rank's share of each split
layer (attention heads, KV heads, MLP columns); :func:`current` tells its constructors which share.
A model built outside it (every draft head that runs on the driver alone) is whole, so proposers
that know nothing of parallelism keep working unchanged.

The groups are ``torch.distributed`` process groups made directly from a store, not the default
(global) group: an engine opens and closes its own, so several engines can live in one process
(tests do) and none leaks into the user's own use of ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# A collective of the forward pass that waits this long has lost a rank that is still alive
# but stuck; a rank that exits closes its sockets and fails the collective at once instead.
COMPUTE_TIMEOUT = timedelta(minutes=10)
# Workers wait for the driver's next command as long as the server idles.
CONTROL_TIMEOUT = timedelta(days=365)
# Control messages up to this size travel in one broadcast; longer ones need a second.
MESSAGE_BUFFER_BYTES = 1 << 12


@dataclass
class CollectiveClock:
    """Calls of each collective on this rank and the seconds they took (waiting for the other
    ranks included): what a split costs per step, the figure that matters on real devices."""

    all_reduces: int = 0
    all_reduce_s: float = 0.0
    broadcasts: int = 0
    broadcast_s: float = 0.0


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size``; ``compute`` all-reduces partial sums of the forward pass
    (gloo on the CPU, NCCL on CUDA), ``control`` (gloo) carries the driver's commands."""

    rank: int
    size: int
    compute: Any = None  # torch.distributed ProcessGroup
    control: Any = None  # torch.distributed ProcessGroup
    # The rendezvous store; the groups made through it need it alive (rank 0 serves it).
    store: Any = None
    clock: CollectiveClock = field(default_factory=CollectiveClock, compare=False)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place: one collective per attention or MLP block."""
        if self.size > 1:
            start = time.perf_counter()
            self.compute.allreduce([tensor]).wait()
            self.clock.all_reduces += 1
            self.clock.all_reduce_s += time.perf_counter() - start
        return tensor

    def split(self, total: int) -> int:
        """This rank's share of ``total`` (heads, columns); the configuration check guarantees
        that ``total`` divides evenly."""
        if total % self.size:
            raise ValueError(f"{total} does not split evenly over {self.size} tensor-parallel ranks")
        return total // self.size

    def split_fields(self, config: T, *names: str) -> T:
        """``config`` (a dataclass) with each named count replaced by this rank's share: the shape
        one rank builds of a layer whose heads or columns are split."""
        if self.size == 1:
            return config
        return replace(config, **{name: self.split(getattr(config, name)) for name in names})

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous slice of ``tensor`` along ``dim``."""
        return tensor.narrow(dim, self.rank * self.split(tensor.shape[dim]), tensor.shape[dim] // self.size)

    def broadcast_object(self, obj: Any = None) -> Any:
        """The driver's ``obj`` on every rank (workers pass nothing): pickled into a byte tensor,
        one broadcast when it fits :data:`MESSAGE_BUFFER_BYTES`, two otherwise."""
        start = time.perf_counter()
        buffer = torch.zeros(MESSAGE_BUFFER_BYTES + 8, dtype=torch.uint8)
        payload = b""
        if self.is_driver:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            buffer[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
            head = min(len(payload), MESSAGE_BUFFER_BYTES)
            buffer[8 : 8 + head] = torch.frombuffer(bytearray(payload[:head]), dtype=torch.uint8)
        self.control.broadcast(buffer, 0).wait()
        length = int(buffer[:8].view(torch.int64).item())
        if length <= MESSAGE_BUFFER_BYTES:
            data = bytes(buffer[8 : 8 + length].numpy())
        else:
            rest = torch.zeros(length - MESSAGE_BUFFER_BYTES, dtype=torch.uint8)
            if self.is_driver:
                rest.copy_(torch.frombuffer(bytearray(payload[MESSAGE_BUFFER_BYTES:]), dtype=torch.uint8))
            self.control.broadcast(rest, 0).wait()
            data = bytes(buffer[8:].numpy()) + bytes(rest.numpy())
        self.clock.broadcasts += 1
        self.clock.broadcast_s += time.perf_counter() - start
        return obj if self.is_driver else pickle.loads(data)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (startup reports: ready or an error)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.control.allgather([sizes], [torch.tensor([len(payload)], dtype=torch.int64)]).wait()
        width = max(int(s.item()) for s in sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        gathered = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.size)]
        self.control.allgather([gathered], [mine]).wait()
        return [pickle.loads(bytes(t[: int(s.item())].numpy())) for t, s in zip(gathered, sizes, strict=True)]


SINGLE = TensorParallel(rank=0, size=1)

_CURRENT: ContextVar[TensorParallel] = ContextVar("sonar_tensor_parallel", default=SINGLE)


def current() -> TensorParallel:
    """The group models built now are split over (:data:`SINGLE` outside any scope)."""
    return _CURRENT.get()


@contextlib.contextmanager
def tensor_parallel_scope(parallel: TensorParallel) -> Iterator[TensorParallel]:
    """Build models split over ``parallel`` inside this block."""
    token = _CURRENT.set(parallel)
    try:
        yield parallel
    finally:
        _CURRENT.reset(token)


def driver_store(host: str = "127.0.0.1") -> dist.TCPStore:
    """The rendezvous store rank 0 serves, on a port the system picks (``store.port``), so no
    two engines on one host can race for a port."""
    return dist.TCPStore(host, 0, is_master=True, timeout=COMPUTE_TIMEOUT, wait_for_workers=False)


def worker_store(host: str, port: int) -> dist.TCPStore:
    """A worker's connection to the driver's rendezvous store."""
    return dist.TCPStore(host, port, is_master=False, timeout=COMPUTE_TIMEOUT)


def open_groups(rank: int, size: int, store: dist.Store, device: torch.device) -> TensorParallel:
    """Join the group of ``size`` ranks that rendezvous through ``store``.

    The compute group is NCCL on CUDA devices, gloo otherwise; the control group is always gloo
    (commands are host objects). Blocks until every rank has joined.
    """
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COMPUTE_TIMEOUT
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, size, options)
    else:
        compute = dist.ProcessGroupGloo(dist.PrefixStore("compute", store), rank, size, COMPUTE_TIMEOUT)
    return TensorParallel(rank=rank, size=size, compute=compute, control=control, store=store)
