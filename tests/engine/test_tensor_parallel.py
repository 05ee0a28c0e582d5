"""Tensor parallelism on CPU (gloo, 2 ranks): greedy output split over two ranks equals one rank's
token for token in float32, without and with every speculation method; the configuration errors;
a rank that dies takes the engine down with its own error; no worker outlives its engine."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sonar_core.config.parallel import cpu_oversubscription_warning, usable_cores
from sonar_core.engine.tensor_parallel import Forward, TensorParallelError, TensorParallelWorkers
from sonar_core.errors import ConfigError
from sonar_core.layers.tensor_parallel import TensorParallel
from sonar_core.models.sharding import ShardRule
from sonar_core.testing.block_drafters import build_block_drafter
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.eagle_heads import build_eagle_head
from sonar_core.testing.losslessness import greedy_outputs, random_prompts
from sonar_core.testing.medusa_heads import build_medusa_head, build_mlp_speculator
from sonar_core.testing.mtp_layers import build_mimo_target

PROMPTS = random_prompts(3, seed=17, max_len=24) + [[5, 6, 7, 5, 6, 7, 5, 6]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for every purpose but its exit status
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(pid) for pid in pids)


def split_outputs(target: Path, speculative_config: dict[str, Any] | None = None, **engine: Any) -> tuple[list, Any]:
    """Greedy outputs at tensor_parallel_size=2; the engine is closed and its workers gone."""
    tokens, llm = greedy_outputs(target, PROMPTS, speculative_config, tensor_parallel_size=2, **engine)
    pids = llm.engine.workers.worker_pids
    assert len(pids) == 1
    llm.engine.close()
    assert _gone(pids), "a worker outlived its engine"
    return tokens, llm


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tp-qwen3") / "t", arch="qwen3", num_layers=3)


@pytest.fixture(scope="module")
def qwen3_plain(qwen3: Path) -> list[list[int]]:
    return greedy_outputs(qwen3, PROMPTS)[0]


# --------------------------------------------------------------------------------- plain decoding
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen2", {}), ("qwen3", {})],
    ids=["llama-biases", "qwen2", "qwen3"],
)
def test_two_ranks_decode_like_one(tmp_path: Path, arch: str, overrides: dict[str, Any]):
    target = build_tiny_checkpoint(tmp_path / "t", arch=arch, num_layers=2, config_overrides=overrides)
    plain, _ = greedy_outputs(target, PROMPTS)
    split, llm = split_outputs(target)
    assert split == plain
    # Each rank holds half the KV heads, so the same budget holds twice the blocks.
    assert llm.engine.model.kv_cache_specs()[0].num_kv_heads == 1


# ----------------------------------------------------------------------------------- speculation
def _ngram(_: Path, __: Path) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def _draft_model(target: Path, folder: Path, draft_tp: int) -> dict[str, Any]:
    draft = build_tiny_checkpoint(folder, arch="qwen3", num_layers=1, seed=3)
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": draft_tp}


METHODS = {
    "ngram": _ngram,
    "ngram_gpu": lambda t, f: {**_ngram(t, f), "method": "ngram_gpu"},
    "suffix": lambda t, f: {"method": "suffix", "num_speculative_tokens": 4},
    "draft_model-tp1": lambda t, f: _draft_model(t, f, 1),
    "draft_model-tp2": lambda t, f: _draft_model(t, f, 2),
    "eagle": lambda t, f: {"method": "eagle", "model": str(build_eagle_head(t, f, method="eagle")),
                           "num_speculative_tokens": 3},
    "eagle3": lambda t, f: {"method": "eagle3", "model": str(build_eagle_head(t, f, draft_vocab_size=128)),
                            "num_speculative_tokens": 3},
    "medusa": lambda t, f: {"method": "medusa", "model": str(build_medusa_head(t, f)), "num_speculative_tokens": 3},
    "mlp_speculator": lambda t, f: {"method": "mlp_speculator", "model": str(build_mlp_speculator(t, f)),
                                    "num_speculative_tokens": 3},
    "dflash": lambda t, f: {"method": "dflash", "model": str(build_block_drafter(t, f, layout="zlab", block_size=4)),
                            "num_speculative_tokens": 3},
    "dspark": lambda t, f: {"method": "dspark", "num_speculative_tokens": 7,
                            "model": str(build_block_drafter(t, f, layout="deepspec", block_size=7, markov_rank=4))},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_speculation_over_two_ranks_is_lossless(qwen3: Path, qwen3_plain: list, tmp_path: Path, method: str):
    config = METHODS[method](qwen3, tmp_path / "draft")
    split, llm = split_outputs(qwen3, config)
    assert split == qwen3_plain
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_seeded_sampling_over_two_ranks_draws_what_one_rank_draws(qwen3: Path):
    """The sampler runs once, on the driver, from logits the ranks agree on: a seeded request
    draws the same tokens (a float32 logit may move in its last bits, which a seeded uniform draw
    meets with negligible probability)."""
    from aphrodite import LLM, SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    drawn = {}
    for size in (1, 2):
        llm = LLM(model=str(qwen3), dtype="float32", device="cpu", tensor_parallel_size=size,
                  speculative_config=config)
        drawn[size] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.engine.close()
    assert drawn[2] == drawn[1]


def test_a_split_draft_model_holds_half_its_kv_heads(qwen3: Path, tmp_path: Path):
    config = _draft_model(qwen3, tmp_path / "draft", 2)
    _, llm = greedy_outputs(qwen3, PROMPTS[:1], config, tensor_parallel_size=2, max_tokens=4)
    try:
        assert llm.engine.speculator.capabilities.kv_layers[0].num_kv_heads == 1
    finally:
        llm.engine.close()


def test_mtp_layers_of_a_split_target_draft_on_the_driver(tmp_path: Path):
    qwen2 = build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2", num_layers=2)
    mimo = build_mimo_target(qwen2, tmp_path / "mimo")
    plain, _ = greedy_outputs(mimo, PROMPTS)
    split, llm = split_outputs(mimo, {"method": "mtp", "num_speculative_tokens": 1})
    assert split == plain
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_exported_hidden_states_are_the_full_states(qwen3: Path, qwen3_plain: list, tmp_path: Path):
    from safetensors.torch import load_file

    def export(folder: Path, **engine: Any) -> dict[str, torch.Tensor]:
        config = {"method": "extract_hidden_states", "output_dir": str(folder), "layer_ids": [0, 2]}
        tokens, llm = greedy_outputs(qwen3, PROMPTS[:1], config, **engine)
        assert tokens == qwen3_plain[:1]
        if engine:
            llm.engine.close()
        (file,) = sorted(folder.rglob("*.safetensors"))
        return load_file(file)

    whole, split = export(tmp_path / "one"), export(tmp_path / "two", tensor_parallel_size=2)
    assert whole.keys() == split.keys()
    for name, tensor in whole.items():
        torch.testing.assert_close(split[name], tensor, rtol=1e-3, atol=1e-4)  # summed in another order


def test_a_method_that_keeps_its_draft_whole_says_so(qwen3: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    config = {**METHODS["eagle3"](qwen3, tmp_path / "head"), "draft_tensor_parallel_size": 2}
    with caplog.at_level("WARNING", logger="sonar.engine"):
        _, llm = greedy_outputs(qwen3, PROMPTS[:1], config, tensor_parallel_size=2, max_tokens=2)
    llm.engine.close()
    assert "runs its draft layers whole on the driver rank" in caplog.text


# --------------------------------------------------------------------------------- configuration
def test_a_size_that_does_not_divide_the_heads_is_refused(qwen3: Path):
    from aphrodite import LLM

    with pytest.raises(ConfigError) as info:
        LLM(model=str(qwen3), device="cpu", tensor_parallel_size=3)
    assert info.value.field == "tensor_parallel_size"
    assert "num_attention_heads=4" in info.value.message and "(1, 2, 4)" in info.value.fix


def test_an_architecture_that_cannot_split_is_refused(tmp_path: Path):
    from aphrodite import LLM

    target = build_tiny_checkpoint(tmp_path / "ds", arch="deepseek_v3", num_layers=2)
    with pytest.raises(ConfigError) as info:
        LLM(model=str(target), device="cpu", tensor_parallel_size=2)
    assert info.value.field == "tensor_parallel_size"
    assert "DeepseekV3ForCausalLM models cannot be split" in info.value.message
    assert "--data-parallel-size" in info.value.fix


def test_draft_branches_are_refused_on_a_split_target(qwen3: Path):
    from sonar_core.config import validate_config
    from sonar_core.plugins import get_plugin_manager

    speculative = {"method": "mtp", "num_speculative_tokens": 2, "num_draft_branches": 2}
    with pytest.raises(ConfigError) as info:
        validate_config({"model": str(qwen3), "tensor_parallel_size": 2, "speculative_config": speculative},
                        get_plugin_manager())
    assert info.value.field == "speculative_config.num_draft_branches"


def test_a_split_draft_must_divide_too(qwen3: Path, tmp_path: Path):
    from aphrodite import LLM

    draft = build_tiny_checkpoint(tmp_path / "d", arch="qwen3", num_layers=1, num_heads=3, num_kv_heads=3, head_dim=16)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}
    with pytest.raises(ConfigError) as info:
        LLM(model=str(qwen3), device="cpu", tensor_parallel_size=2, speculative_config=config)
    assert info.value.field == "speculative_config.draft_tensor_parallel_size"


def test_the_configuration_rules_and_the_models_name_the_same_splittable_families():
    """SPLIT_COUNTS (torch-free, for the checks) and the classes' shard_rules must agree."""
    from sonar_core.config.parallel import SPLIT_COUNTS
    from sonar_core.models.base import CausalLM
    from sonar_core.models.registry import BUILTIN_ARCHITECTURES, get_model_class

    for architecture in BUILTIN_ARCHITECTURES:
        cls = get_model_class({"architectures": [architecture]})
        assert (cls.shard_rules is not CausalLM.shard_rules) == (architecture in SPLIT_COUNTS), architecture


def test_more_ranks_than_cores_is_a_warning():
    assert cpu_oversubscription_warning(usable_cores()) is None
    assert "more ranks than this machine has cores" in cpu_oversubscription_warning(usable_cores() + 1)


def test_shard_rules_split_whole_heads_and_stacked_blocks():
    tensor = torch.arange(12).reshape(6, 2)
    rank1 = TensorParallel(rank=1, size=2)
    assert ShardRule("w", 0).apply(tensor, rank1).tolist() == tensor[3:].tolist()
    assert ShardRule("w", 1).apply(tensor, rank1).tolist() == tensor[:, 1:].tolist()
    # Blocks of 2 and 4 rows: rank 1 keeps row 1 of the first and rows 4-5 of the second.
    assert ShardRule("w", 0, segments=(2, 4)).apply(tensor, rank1).tolist() == tensor[[1, 4, 5]].tolist()


# ------------------------------------------------------------------------------------- failures
@pytest.fixture
def split_engine(qwen3: Path) -> Iterator[Any]:
    from aphrodite import LLM

    llm = LLM(model=str(qwen3), dtype="float32", device="cpu", tensor_parallel_size=2)
    yield llm.engine
    llm.engine.close()


def _one_step(engine: Any) -> None:
    engine.add_request([5, 6, 7])
    while engine.has_unfinished_requests():
        engine.step()


def test_a_rank_that_raises_stops_the_engine_with_its_error(split_engine: Any):
    _one_step(split_engine)
    pids = split_engine.workers.worker_pids
    # A forward pass without its metadata makes the worker raise.
    split_engine.workers.send(Forward("target", None, None, None, {}, None))
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 failed: TypeError: AttentionMetadata"):
        _one_step(split_engine)
    assert _gone(pids)
    with pytest.raises(TensorParallelError, match="rank 1 failed"):  # and it stays down
        _one_step(split_engine)


def test_a_killed_rank_stops_the_engine_without_a_hang(split_engine: Any):
    _one_step(split_engine)
    (pid,) = split_engine.workers.worker_pids
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 failed: exited with code -9"):
        _one_step(split_engine)
    assert time.monotonic() - started < 30


def test_a_dead_rank_of_four_takes_the_others_down(tmp_path: Path):
    """Four ranks (two per core here): rank 2 is killed; the error names it and no rank is left."""
    from aphrodite import LLM

    target = build_tiny_checkpoint(tmp_path / "t", arch="qwen3", num_layers=1, num_heads=4, num_kv_heads=4)
    llm = LLM(model=str(target), dtype="float32", device="cpu", tensor_parallel_size=4)
    try:
        _one_step(llm.engine)
        pids = llm.engine.workers.worker_pids
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(TensorParallelError, match="tensor-parallel rank 2 failed"):
            _one_step(llm.engine)
        assert _gone(pids)
    finally:
        llm.engine.close()


def test_workers_die_with_their_driver(tmp_path: Path, qwen3: Path):
    """SIGKILL on the driver (no chance to clean up) still leaves no worker behind."""
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(
        "import sys\nfrom aphrodite import LLM\n"
        f"llm = LLM(model={str(qwen3)!r}, device='cpu', dtype='float32', tensor_parallel_size=2)\n"
        "print(*llm.engine.workers.worker_pids, flush=True)\nsys.stdin.read()\n"
    )
    driver = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
        driver.kill()
        driver.wait(30)
        assert _gone(pids)
    finally:
        driver.kill()


def test_a_worker_that_cannot_start_fails_at_once(monkeypatch: pytest.MonkeyPatch):
    """A worker that exits before it joins fails the startup now, not after the rendezvous timeout."""
    import sys

    monkeypatch.setattr(sys, "executable", "/bin/false")
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 failed to start: exited with code 1"):
        TensorParallelWorkers(2, torch.device("cpu"), 1)
    assert time.monotonic() - started < 30
