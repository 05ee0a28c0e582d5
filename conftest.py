"""Settings for every test of the repository, plugins included."""

import os

# No test reaches a real Hub: repository ids resolve from the cache or fail. The tests of
# downloads point the client at a fake hub on loopback (sonar_core.testing.fake_hub), and without
# telemetry the client sends nothing of its own. Set before huggingface_hub is imported (it reads
# the environment then); subprocesses inherit both.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

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
