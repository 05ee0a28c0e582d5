"""``python -m sonar_core.engine.tensor_parallel_worker RANK SIZE PORT DEVICE THREADS``: one
tensor-parallel worker (started by :class:`~sonar_core.engine.tensor_parallel.TensorParallelWorkers`).

A module of its own so that the command classes the driver pickles resolve to
:mod:`sonar_core.engine.tensor_parallel` here too, not to ``__main__``.
"""

import sys

from sonar_core.engine.tensor_parallel import worker_main

if __name__ == "__main__":
    rank, size, port, device, threads = sys.argv[1:6]
    sys.exit(worker_main(int(rank), int(size), int(port), device, int(threads)))
