"""Every configuration rule through the command line: exit status 2, the message, no traceback.

``serve --check-config`` validates everything (flags, speculative config, the model's config.json)
and exits without loading weights, so each case runs in well under a second.
"""

from __future__ import annotations

import json

import pytest
import torch

NGRAM_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


@pytest.fixture
def model(make_model_dir):
    return str(make_model_dir(max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2))


def spec(**keys) -> str:
    return json.dumps({"method": "echo_test", "num_speculative_tokens": 2, **keys})


def assert_config_error(result, *expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


def test_bad_json_quotes_points_and_advises(run_aphrodite):
    result = run_aphrodite("serve", "x", "--speculative-config", "{method: ngram}")
    assert_config_error(
        result,
        "--speculative-config: the value is not valid JSON",
        "    {method: ngram}\n     ^",
        "put single quotes around the complete JSON object in Bash",
        "JSON keys and string values keep their double quotes",
    )
    assert result.stdout == ""


def test_json_split_by_the_shell(run_aphrodite, model):
    # What Bash passes for: --speculative-config {"method": "ngram", "num_speculative_tokens": 4}
    result = run_aphrodite("serve", model, "--speculative-config", "{method:", "ngram,", "num_speculative_tokens:", "4}")
    assert_config_error(result, "the shell split the value into 4 arguments", "single quotes")


def test_json_that_is_not_an_object(run_aphrodite, model):
    assert_config_error(run_aphrodite("serve", model, "--speculative-config", '"ngram"'), "must be a JSON object")


def test_generate_reports_bad_json_the_same_way(run_aphrodite):
    result = run_aphrodite("generate", "x", "--prompt", "hi", "--speculative-config", "{method: ngram}")
    assert_config_error(result, "    {method: ngram}\n     ^", "single quotes")


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"method": "mtp"}, ["speculative_config.method", "sonar-mtp, which is installed but not loaded", "add 'mtp' to SONAR_PLUGINS"]),
        ({"method": "deepseek_mtp"}, ["speculative_config.method", "sonar-mtp, which is installed but not loaded"]),
        ({"method": "echo_tset"}, ["Installed methods: custom_class, echo_test", "did you mean 'echo_test'?"]),
        ({"method": None}, ["speculative_config.method: no method is set"]),
        ({"num_speculative_tokens": 0}, ["speculative_config.num_speculative_tokens", "1 or more"]),
        ({"num_speculative_tokens": None}, ["speculative_config.num_speculative_tokens", "add \"num_speculative_tokens\""]),
        ({"num_speculative_tokens": 9}, ["speculative_config.num_speculative_tokens: method 'echo_test' drafts at most 8"]),
        ({"draft_tensor_parallel_size": 2}, ["speculative_config.draft_tensor_parallel_size", "set draft_tensor_parallel_size to 1"]),
        ({"max_model_len": 1024}, ["speculative_config.max_model_len", "target checkpoint's limit of 512"]),
        ({"use_heterogeneous_vocab": True, "draft_sample_method": "probabilistic"},
         ["speculative_config.use_heterogeneous_vocab", "greedy"]),
        ({"draft_sample_method": "random"}, ["speculative_config.draft_sample_method", "'greedy' or 'probabilistic'"]),
        ({"repeats": 2}, ["speculative_config.repeats: 'repeats' is not an option of method 'echo_test'",
                          "did you mean 'repeat'?"]),
        ({"tensor_parallel_size": 2}, ["use draft_tensor_parallel_size"]),
        ({"method": "custom_class", "custom_class": "no_such_module:Cls"},
         ["speculative_config.custom_class: module 'no_such_module' was not found"]),
    ],
)
def test_speculative_rules(run_aphrodite, model, keys, expected):
    config = {key: value for key, value in json.loads(spec(**keys)).items() if value is not None}
    result = run_aphrodite("serve", model, "--check-config", "--speculative-config", json.dumps(config))
    assert_config_error(result, *expected)


def test_draft_max_model_len_above_the_draft_checkpoints_limit(run_aphrodite, make_model_dir):
    target = make_model_dir("target", max_position_embeddings=4096)
    draft = make_model_dir("draft", max_position_embeddings=1024)
    result = run_aphrodite(
        "serve", str(target), "--check-config", "--speculative-config", spec(model=str(draft), max_model_len=2048)
    )
    assert_config_error(result, "draft checkpoint's limit of 1024")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tensor-parallel-size", "3"], ["tensor_parallel_size", "does not split evenly over 3 ranks"]),
        (["-tp", "0"], ["tensor_parallel_size must be at least 1, got 0"]),
        (["-pp", "2"], ["pipeline parallelism is not supported", "tensor parallelism or data parallelism"]),
        (["--gpu-memory-utilization", "1.5"], ["gpu_memory_utilization", "--gpu-memory-utilization"]),
        (["--dtype", "fp8"], ["dtype: unknown dtype 'fp8'"]),
        (["--device", "tpu"], ["device: unknown device 'tpu'"]),
        (["--max-model-len", "1000"], ["max_model_len: 1000 tokens exceeds the model's limit of 512", "--max-model-len 512"]),
        (["--max-num-seqs", "0"], ["max_num_seqs: must be a positive number"]),
        (["--max-num-batched-tokens", "8"], ["max_num_batched_tokens", "at least 256"]),
        (["--block-size", "0"], ["block_size"]),
        (["--kv-cache-memory-gb", "0"], ["kv_cache_memory_gb"]),
        (["--max-num-seqs", "many"], ["argument --max-num-seqs: invalid int value: 'many'"]),
        (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    ],
)
def test_engine_rules(run_aphrodite, model, flags, expected):
    assert_config_error(run_aphrodite("serve", model, "--check-config", *flags), *expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_a_device(run_aphrodite, model):
    assert_config_error(run_aphrodite("serve", model, "--check-config", "--device", "cuda"), "--device cpu")


def test_model_that_does_not_exist(run_aphrodite, tmp_path):
    assert_config_error(run_aphrodite("serve", str(tmp_path / "missing"), "--check-config"), "model:", "config.json")


def test_generate_rejects_bad_sampling_values(run_aphrodite, model):
    assert_config_error(run_aphrodite("generate", model, "--prompt", "hi", "--temperature", "-1"), "temperature")


def test_valid_configuration_with_the_documented_flags(run_aphrodite, model):
    result = run_aphrodite(
        "serve", model, "--check-config", "--trust-remote-code", "--max-model-len", "512", "--max-num-seqs", "32",
        "--gpu-memory-utilization", "0.85", "--device", "cpu", "--dtype", "bf16", "--seed", "7",
        "--speculative-config", '{\n  "method": "echo_alias",\n  "num_speculative_tokens": 3\n}',
    )
    assert result.returncode == 0, result.stderr
    assert "Configuration is valid." in result.stdout
    assert "speculative decoding: echo_test (sonar-test-plugin 0.3.1), num_speculative_tokens: 3" in result.stdout
    assert "old name" not in result.stderr  # a plain alias is accepted silently


def test_an_old_name_is_accepted_with_a_deprecation_warning(run_aphrodite, model):
    result = run_aphrodite("serve", model, "--check-config", "--speculative-config", '{"method": "echo_v0", "num_speculative_tokens": 2}')
    assert result.returncode == 0, result.stderr
    assert "'echo_v0' is an old name of 'echo_test'; write \"method\": \"echo_test\" in new configurations" in result.stderr


def test_warnings_do_not_fail_the_check(run_aphrodite, model):
    result = run_aphrodite("serve", model, "--check-config", "--speculative-config", spec(num_speculative_tokens=5))
    assert result.returncode == 0
    assert "WARNING" in result.stderr and "is deep for this method" in result.stderr
    assert "warnings: 1" in result.stdout


def test_without_a_command_usage_is_printed(run_aphrodite):
    result = run_aphrodite()
    assert result.returncode == 2
    assert "serve" in result.stderr and "plugins" in result.stderr


@pytest.mark.parametrize("branches", [3, 1])  # a set 1 differs from unset, where the engine may branch
def test_check_config_shows_draft_branches(run_aphrodite, branches):
    result = run_aphrodite(
        "serve", "--check-config", "--speculative-config",
        f'{{"method": "eagle3", "num_speculative_tokens": 4, "num_draft_branches": {branches}}}',
        env={"SONAR_PLUGINS": None},
    )
    assert result.returncode == 0, result.stderr
    assert "eagle3" in result.stdout and f"num_speculative_tokens: 4, num_draft_branches: {branches}" in result.stdout


def test_check_config_shows_a_set_draft_stop(run_aphrodite):
    result = run_aphrodite(
        "serve", "--check-config", "--speculative-config",
        '{"method": "eagle3", "num_speculative_tokens": 6, "draft_stop_confidence": 0.4}', env={"SONAR_PLUGINS": None},
    )
    assert result.returncode == 0, result.stderr
    assert "num_speculative_tokens: 6, draft_stop_confidence: 0.4" in result.stdout
