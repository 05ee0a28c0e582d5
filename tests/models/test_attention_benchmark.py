"""The attention benchmark prints its two tables and leaves the machine's in-place rule as it was."""

import pytest
import torch

from sonar_core import cpu_kernels
from sonar_core.layers import attention
from sonar_core.models import attention_benchmark


def test_attending_pins_the_rule_for_the_block_only():
    own = attention.in_place_policy
    with attention_benchmark.attending(attention_benchmark.IN_PLACE):
        assert attention.in_place_policy(torch.bfloat16) == attention_benchmark.IN_PLACE
    assert attention.in_place_policy is own


@pytest.mark.skipif(cpu_kernels.load() is None, reason="Sonar's CPU kernels are not built here")
def test_tables_of_kernel_calls_and_whole_steps(checkpoints, capsys):
    path = checkpoints.get("llama")
    attention_benchmark.main(
        ["--model", str(path), "--dtype", "float32", "--threads", "1", "--contexts", "20,40",
         "--queries", "1,3", "--steps", "1+12,16+9", "--iters", "1"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("float32, 1 threads, median of 1; CPU: ")
    kernel_rows = [line for line in lines if line.startswith(("| 20 |", "| 40 |"))]
    step_rows = [line for line in lines if line.startswith(("| 1 + 12 |", "| 16 + 9 |"))]
    assert len(kernel_rows) == 2 and len(step_rows) == 2
    assert all(float(cell) > 0 for row in kernel_rows + step_rows for cell in row.strip("|").split("|")[1:])
