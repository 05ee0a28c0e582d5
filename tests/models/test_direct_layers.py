"""Plain decoder layers run as direct kernel calls (``sonar_core.layers.direct_layers``): the same
bits as their modules, taken only where every kernel applies."""

from __future__ import annotations

import contextlib
import random
import sys

import pytest
import torch

from sonar_core import cpu_kernels
from sonar_core.layers import attention, direct_layers
from sonar_core.layers.direct_layers import DirectLayer, through_modules
from sonar_core.models.loader import load_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason=f"CPU kernels unavailable: {cpu_kernels.problem()}")

# A prefill, then steps that mix decodes, a prompt arriving in two chunks and a sequence verifying
# four drafted tokens at once, then plain decodes.
PROMPTS = {"a": 5, "b": 19, "c": 2}  # "b" longer than 16 queries


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
    """Whether a step's attention runs in place (so its layers may run as one stack kernel call)
    under a pinned query limit (``pin_in_place_limit``): decodes always, up to that many queries
    per sequence where the kernels verify in place."""
    return max(len(tokens) for tokens in new.values()) <= attention.in_place_policy(torch.float32).max_queries


class _Counts:
    """Layer calls that ran directly: one by one, and inside ``decoder_layers`` kernel calls."""

    def __init__(self) -> None:
        self.single = self.stacked = self.stacks = 0

    @property
    def layers(self) -> int:
        return self.single + self.stacked


def _counting(patch: pytest.MonkeyPatch) -> _Counts:
    counts = _Counts()
    forward, run_stack = DirectLayer.forward, direct_layers.run_stack

    def counted_forward(self, *args):
        counts.single += 1
        return forward(self, *args)

    def counted_stack(ops, entries, *args):
        counts.stacked += len(entries)
        counts.stacks += 1
        return run_stack(ops, entries, *args)

    patch.setattr(DirectLayer, "forward", counted_forward)
    patch.setattr(direct_layers, "run_stack", counted_stack)
    return counts


def _run(model, paged_runner, steps, monkeypatch, direct: bool, capture_layers=()):
    """Logits and captured states of every step, and the direct layer calls' counts."""
    runner = paged_runner(model, block_size=4)
    with monkeypatch.context() as patch, contextlib.ExitStack() as stack:
        counts = _counting(patch)
        if not direct:
            stack.enter_context(through_modules())
        outputs = [runner.step(new, capture_layers=capture_layers) for new in steps]
    return [logits for logits, _ in outputs], [states for _, states in outputs], counts


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
def test_direct_layers_give_the_modules_bits(arch, extra, dtype, checkpoints, paged_runner, monkeypatch, pin_in_place_limit):
    # The query limit of AVX2 builds, so that the steps mix both kinds on every CPU.
    pin_in_place_limit(8)
    model = load_model(checkpoints.get(arch, num_layers=3, **extra), dtype, "cpu").model
    steps = _steps(model.shared_modules().vocab_size)
    direct, _, direct_calls = _run(model, paged_runner, steps, monkeypatch, direct=True)
    modules, _, module_calls = _run(model, paged_runner, steps, monkeypatch, direct=False)
    assert module_calls.layers == 0
    # Every step runs its layers directly, the prefill's too (its 19-token prompt gathers the
    # context for attention inside the direct layers).
    assert direct_calls.layers == len(steps) * model.num_layers
    # Layers without per-head q/k norms run as one kernel call per step that attends in place,
    # one by one in the others.
    in_place_steps = sum(map(_in_place, steps))
    assert 0 < in_place_steps < len(steps)
    stacked = arch != "qwen3"
    expected_calls = (in_place_steps, (len(steps) - in_place_steps) * model.num_layers)
    assert (direct_calls.stacks, direct_calls.single) == (expected_calls if stacked else (0, direct_calls.layers))
    for number, (got, expected) in enumerate(zip(direct, modules, strict=True)):
        for seq in expected:
            assert torch.equal(got[seq], expected[seq]), f"step {number} {seq}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_capture_keeps_the_stack_whole_and_records_the_modules_states(
    dtype, checkpoints, paged_runner, monkeypatch, pin_in_place_limit
):
    """EAGLE-3 reads states after chosen layers (here the embedding, the first, third and last
    layer's): the kernel copies them out as it goes, one call for all four layers."""
    pin_in_place_limit(8)
    model = load_model(checkpoints.get("llama", num_layers=4), dtype, "cpu").model
    steps = _steps(model.shared_modules().vocab_size)
    capture = (0, 1, 3, 4)
    direct, direct_states, counts = _run(model, paged_runner, steps, monkeypatch, direct=True, capture_layers=capture)
    modules, module_states, _ = _run(model, paged_runner, steps, monkeypatch, direct=False, capture_layers=capture)
    assert counts.stacks == sum(map(_in_place, steps)) > 0
    for number, (got, expected) in enumerate(zip(direct_states, module_states, strict=True)):
        for layer in capture:
            for seq in expected[layer]:
                assert torch.equal(got[layer][seq], expected[layer][seq]), f"step {number} layer {layer} {seq}"
    for got, expected in zip(direct, modules, strict=True):
        assert all(torch.equal(got[seq], expected[seq]) for seq in expected)


def test_a_step_with_rows_too_long_to_attend_in_place_runs_the_layers_one_by_one(
    checkpoints, paged_runner, monkeypatch, pin_in_place_limit
):
    """A 20-token prompt and a row verifying more drafts than attend in place: direct layers, no
    stack kernel call."""
    pin_in_place_limit(8)  # the query limit of AVX2 builds
    model = load_model(checkpoints.get("llama", num_layers=3), torch.float32, "cpu").model
    steps = [{"a": list(range(20))}, {"a": list(range(20, 32))}]
    direct, _, calls = _run(model, paged_runner, steps, monkeypatch, direct=True)
    modules, _, _ = _run(model, paged_runner, steps, monkeypatch, direct=False)
    assert (calls.single, calls.stacks) == (2 * model.num_layers, 0)
    for got, expected in zip(direct, modules, strict=True):
        assert torch.equal(got["a"], expected["a"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prompts_attend_in_place_in_the_stack_kernel_where_the_cpu_has_no_limit(
    dtype, checkpoints, paged_runner, monkeypatch, pin_in_place_limit
):
    """AVX-512 CPUs without AMX attend every step in place (no query limit): the prefill and the
    mixed steps run as one kernel call each, with the modules' bits."""
    if not cpu_kernels.attention_verifies_in_place():
        pytest.skip("these kernels attend only decode steps in place")
    pin_in_place_limit(sys.maxsize)
    model = load_model(checkpoints.get("llama", num_layers=3), dtype, "cpu").model
    steps = _steps(model.shared_modules().vocab_size)
    direct, _, calls = _run(model, paged_runner, steps, monkeypatch, direct=True)
    modules, _, _ = _run(model, paged_runner, steps, monkeypatch, direct=False)
    assert (calls.stacks, calls.single) == (len(steps), 0)
    for number, (got, expected) in enumerate(zip(direct, modules, strict=True)):
        for seq in expected:
            assert torch.equal(got[seq], expected[seq]), f"step {number} {seq}"


def test_steps_the_kernels_do_not_take_run_the_modules(checkpoints, paged_runner, monkeypatch):
    """A replaced layer, autograd, and a layer with an output gate (Qwen3-Next's attention)."""
    model = load_model(checkpoints.get("llama", num_layers=3), torch.float32, "cpu").model
    runner = paged_runner(model, block_size=4)
    model._direct_layers()[0][0] = DirectLayer.of(model.model.layers[1])  # stale: not the layer it stands for
    _, _, calls = _run(model, paged_runner, [{"a": [1]}], monkeypatch, direct=True)
    assert (calls.layers, calls.stacks) == (model.num_layers - 1, 1)

    def refuse(*args):
        raise AssertionError("a layer ran directly under autograd")

    metadata = runner.metadata({"a": [1, 2, 3]})
    monkeypatch.setattr(DirectLayer, "forward", refuse)
    monkeypatch.setattr(direct_layers, "run_stack", refuse)
    with torch.enable_grad():
        hidden = model(torch.tensor([1, 2, 3]), metadata.positions, runner.caches, metadata)
    assert hidden.shape == (3, 64)

    gated = model.model.layers[0]
    gated.self_attn.output_gate = True
    assert DirectLayer.of(gated) is None


def _runs_with_changes(dtype, checkpoints, paged_runner, monkeypatch, steps, change, runners: int):
    """``steps`` on a two-layer Llama, ``change(model, number)`` before step ``number``, run once
    directly and once through the modules, each over ``runners`` runners in turn (fresh caches
    each); every step must give the modules' bits. Returns, step by step of the direct run, how
    often layers checked their kept arguments themselves and how often they read them anew."""

    def run(direct: bool):
        model = load_model(checkpoints.get("llama", num_layers=2), dtype, "cpu").model
        checks: list[int] = []
        reads: list[int] = []
        with monkeypatch.context() as patch, contextlib.ExitStack() as stack:
            packed_weights, own_check = DirectLayer.packed_weights, direct_layers.LayerKernelArgs.reads

            def counted_read(self, *args):
                reads[-1] += 1
                return packed_weights(self, *args)

            def counted_check(self, *args):
                checks[-1] += 1
                return own_check(self, *args)

            patch.setattr(DirectLayer, "packed_weights", counted_read)
            patch.setattr(direct_layers.LayerKernelArgs, "reads", counted_check)
            if not direct:
                stack.enter_context(through_modules())
            logits = []
            for runner in [paged_runner(model, block_size=4) for _ in range(runners)]:
                for number, new in enumerate(steps):
                    change(model, number)
                    checks.append(0)
                    reads.append(0)
                    logits.append(runner.step(new)[0]["a"])
        return logits, checks, reads

    direct, checks, reads = run(direct=True)
    modules, _, _ = run(direct=False)
    for number, (got, expected) in enumerate(zip(direct, modules, strict=True)):
        assert torch.equal(got, expected), f"step {number}"
    return checks, reads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kept_kernel_arguments_follow_weights_and_caches(dtype, checkpoints, paged_runner, monkeypatch):
    """Each layer's kernel arguments are read once and kept while what they were read from holds.
    A weight changed in place, a norm weight replaced and new caches are each taken up by the next
    step, which gives the modules' bits; unchanged layers are not read again."""
    steps = [{"a": [1, 2, 3]}, {"a": [4]}, {"a": [5]}, {"a": [6]}, {"a": [7]}]

    def change(model, number: int) -> None:
        layer = model.model.layers[1]
        with torch.no_grad():
            if number == 2:
                layer.mlp.down_proj.weight.mul_(2)
            if number == 3:
                norm = layer.post_attention_layernorm
                norm.weight = torch.nn.Parameter(norm.weight * 0.5, requires_grad=False)

    _, reads = _runs_with_changes(dtype, checkpoints, paged_runner, monkeypatch, steps, change, runners=2)
    # First step: both layers; a changed layer once more; the second runner's new caches: both again.
    assert reads == [2, 0, 1, 1, 0] + [2, 0, 1, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_model_checks_what_its_layers_keep_once_a_step(dtype, checkpoints, paged_runner, monkeypatch):
    """While nothing changes, no layer checks its kept arguments itself (the model's one check
    holds); a weight's data swapped, a packed copy made again, a norm replaced or a weight changed
    in place each make the layers check themselves for that step, and the changed layer is read
    again where its arguments went stale. A layer that then runs its module (a projection no
    longer packed) keeps the model from trusting what the layers keep. Every step gives the modules' bits."""
    steps = [{"a": [1, 2, 3]}] + [{"a": [token]} for token in range(4, 13)]

    def change(model, number: int) -> None:
        layer = model.model.layers[1]
        with torch.no_grad():
            if number == 2:
                layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data * 2
            if number == 4:
                layer.mlp.gate_up_proj.pack()
            if number == 5:
                norm = layer.input_layernorm
                norm.weight = torch.nn.Parameter(norm.weight * 0.5, requires_grad=False)
            if number == 6:
                layer.self_attn.qkv_proj.weight.mul_(0.5)
            if number == 8:
                layer.mlp.down_proj.unpack()

    checks, reads = _runs_with_changes(dtype, checkpoints, paged_runner, monkeypatch, steps, change, runners=1)
    assert checks == [0, 0, 2, 0, 2, 2, 2, 0, 2, 2]
    assert reads == [2, 0, 1, 0, 1, 1, 1, 0, 1, 1]
