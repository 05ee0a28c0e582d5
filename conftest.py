"""Settings for every test of the repository, plugins included."""

import os

import torch

# The tests run tiny models, for which intra-op threads only add synchronisation; on a busy
# machine, threads that wait on each other at every operator slow a step down a hundredfold.
# Subprocesses (CLI and server tests) inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
