"""Plain decoder layers run as direct kernel calls (``sonar_core.layers.direct_layers``): the same
bits as their modules, taken only where every kernel applies."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from sonar_core import cpu_kernels
from sonar_core.layers.direct_layers import DirectLayer, through_modules
from sonar_core.models.loader import load_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=f"CPU kernels unavailable: {cpu_kernels.problem()}")

# A prefill, then steps that mix decodes, a prompt arriving in two chunks and a sequence verifying
# four drafted tokens at once, then plain decodes.
PROMPTS = {"a": 5, "b": 11, "c": 2}


def _steps(vocab: int) -> list[dict[str, list[int]]]:
    rng = random.Random(0)
    steps = [{seq: [rng.randrange(vocab) for _ in range(n)] for seq, n in PROMPTS.items()}]
    late = [rng.randrange(vocab) for _ in range(13)]
    for step in range(6):
        new = {seq: [rng.randrange(vocab)] for seq in PROMPTS}
        if step < 2:
            new["d"] = late[:7] if step == 0 else late[7:]
        elif step < 4:
            new["a"] = [rng.randrange(vocab) for _ in range(4)]
        steps.append(new)
    return steps


def _in_place(new: dict[str, list[int]]) -> bool:
    """Whether a step's attention runs in place (so its layers may run directly): decodes always,
    up to 8 queries per sequence where the kernels share keys among queries (AVX-512 builds)."""
    longest = max(len(tokens) for tokens in new.values())
    return longest == 1 or (longest <= 8 and cpu_kernels.attention_shares_keys())


def _run(model, paged_runner, steps, monkeypatch, direct: bool) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Logits of every step, and how many layer calls ran directly."""
    calls = 0
    forward = DirectLayer.forward

    def counted(self, *args):
        nonlocal calls
        calls += 1
        return forward(self, *args)

    runner = paged_runner(model, block_size=4)
    with monkeypatch.context() as patch, contextlib.ExitStack() as stack:
        patch.setattr(DirectLayer, "forward", counted)
        if not direct:
            stack.enter_context(through_modules())
        logits = [runner.step(new)[0] for new in steps]
    return logits, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "arch,extra",
    [
        pytest.param("llama", {}, id="llama"),
        # q/k/v biases, and a sliding window shorter than the prompts on the second layer.
        pytest.param(
            "qwen2",
            {"config_overrides": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}},
            id="qwen2-bias-window",
        ),
        # Per-head q/k norms, and a head size other than hidden_size // num_heads.
        pytest.param("qwen3", {"head_dim": 32}, id="qwen3"),
    ],
)
def test_direct_layers_give_the_modules_bits(arch, extra, dtype, checkpoints, paged_runner, monkeypatch):
    model = load_model(checkpoints.get(arch, **extra), dtype, "cpu").model
    steps = _steps(model.shared_modules().vocab_size)
    direct, direct_calls = _run(model, paged_runner, steps, monkeypatch, direct=True)
    modules, module_calls = _run(model, paged_runner, steps, monkeypatch, direct=False)
    assert module_calls == 0
    # Never the prefill's layers: its 11-token prompt is more queries than attention in place takes.
    assert direct_calls == sum(map(_in_place, steps)) * model.num_layers > 0
    for number, (got, expected) in enumerate(zip(direct, modules, strict=True)):
        for seq in expected:
            assert torch.equal(got[seq], expected[seq]), f"step {number} {seq}"


def test_steps_the_kernels_do_not_take_run_the_modules(checkpoints, paged_runner, monkeypatch):
    """A prompt of more queries than attention in place takes, a replaced layer, autograd, and a
    layer with an output gate (Qwen3-Next's attention)."""
    model = load_model(checkpoints.get("llama"), torch.float32, "cpu").model
    _, calls = _run(model, paged_runner, [{"a": list(range(20))}], monkeypatch, direct=True)
    assert calls == 0

    runner = paged_runner(model, block_size=4)
    model._direct_layers()[0] = DirectLayer.of(model.model.layers[1])  # stale: not the layer it stands for
    _, calls = _run(model, paged_runner, [{"a": [1]}], monkeypatch, direct=True)
    assert calls == model.num_layers - 1

    def refuse(*args):
        raise AssertionError("a layer ran directly under autograd")

    metadata = runner.metadata({"a": [1, 2, 3]})
    monkeypatch.setattr(DirectLayer, "forward", refuse)
    with torch.enable_grad():
        hidden = model(torch.tensor([1, 2, 3]), metadata.positions, runner.caches, metadata)
    assert hidden.shape == (3, 64)

    gated = model.model.layers[0]
    gated.self_attn.output_gate = True
    assert DirectLayer.of(gated) is None
