"""Settings for every test of the repository, plugins included."""

import os

import torch

# The tests run tiny models, for which intra-op threads only add synchronisation; on a busy
# machine, threads that wait on each other at every operator slow a step down a hundredfold.
# Subprocesses (CLI and server tests) inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """Point Sonar's cache (GGUF conversions and metadata, unpacked heads, bench heads) at a folder
    of this test run, so that tests never write into the user's ``~/.cache/sonar``. Subprocesses
    inherit it. A cache the caller set on purpose (``SONAR_CACHE_DIR``) is kept."""
    import tempfile

    if "SONAR_CACHE_DIR" not in os.environ:
        os.environ["SONAR_CACHE_DIR"] = _TEST_CACHE[0] = tempfile.mkdtemp(prefix="sonar-test-cache-")


def pytest_unconfigure(config) -> None:
    import shutil

    if _TEST_CACHE[0] is not None:
        shutil.rmtree(_TEST_CACHE[0], ignore_errors=True)
        os.environ.pop("SONAR_CACHE_DIR", None)
        _TEST_CACHE[0] = None


_TEST_CACHE: list[str | None] = [None]  # the folder pytest_configure made, removed at the end
