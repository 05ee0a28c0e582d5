"""``aphrodite bench startup``: how long a user waits before anything happens.

Two figures, each in fresh processes so that nothing is imported or cached in memory beforehand
(the files on disk, the converted model included, are warm: the first run of a machine converts
the GGUF once, which this does not time):

* **engine ready**: ``python -c "from aphrodite import LLM; LLM(MODEL)"`` from the process's launch
  to ``LLM()`` returning (not to the process's exit, which tears the engine down), and the
  constructor alone;
* **config error**: ``aphrodite serve --check-config`` with a misspelt method, to its exit status 2.

Each is run ``repeats`` times; the table shows the median and the slowest.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sonar_core.bench.report import machine_description, markdown_table

# Prints the wall-clock time at which LLM() returned (what "engine ready" is timed to: the
# process's exit, which tears down the engine, comes after) and the constructor's own seconds.
_READY_SCRIPT = """
import sys, time
from aphrodite import LLM
imported = time.perf_counter()
LLM(sys.argv[1] if sys.argv[1] != "-" else None)
print(f"{time.time()} {time.perf_counter() - imported}")
"""


@dataclass(frozen=True)
class StartupFigures:
    label: str
    seconds: list[float]

    def cells(self) -> list[str]:
        return [self.label, f"{statistics.median(self.seconds):.2f}", f"{max(self.seconds):.2f}", str(len(self.seconds))]


def measure(model: str | None, repeats: int) -> list[StartupFigures]:
    """Engine-ready and config-error times of ``repeats`` fresh processes each."""
    aphrodite = str(Path(sys.executable).parent / "aphrodite")
    total, constructor, error = [], [], []
    for _ in range(repeats):
        spawned = time.time()
        done = subprocess.run(
            [sys.executable, "-c", _READY_SCRIPT, model or "-"], capture_output=True, text=True, check=True
        )
        ready, seconds = done.stdout.split()[-2:]
        total.append(float(ready) - spawned)
        constructor.append(float(seconds))
        started = time.perf_counter()
        refused = subprocess.run(
            [aphrodite, "serve", *([model] if model else []), "--check-config", "--speculative-config",
             '{"method": "ngrm", "num_speculative_tokens": 4}'],
            capture_output=True, text=True,
        )
        error.append(time.perf_counter() - started)
        if refused.returncode != 2:
            raise RuntimeError(f"the misspelt method was not refused as a configuration error: {refused.stderr}")
    return [
        StartupFigures("engine ready (process start to LLM() returning)", total),
        StartupFigures("LLM() constructor alone (imports done)", constructor),
        StartupFigures("config error (aphrodite serve --check-config, misspelt method)", error),
    ]


def render(figures: list[StartupFigures], model: str | None) -> str:
    header = ["figure", "median s", "slowest s", "runs"]
    return "\n".join([
        f"### Startup, {model or 'the embedded default model'} (converted folder cached)",
        "",
        f"Machine: {machine_description()}.",
        "",
        markdown_table(header, [figure.cells() for figure in figures]),
    ])
