"""The Triton rejection kernel returns exactly the torch reference's tokens on the same inputs.

Without a GPU the kernel runs under the Triton interpreter on CPU tensors. Triton reads
TRITON_INTERPRET when it is imported, so the comparison runs in a fresh Python process that has
the variable set: the test executes this file as a script. The kernel is also compiled for
sm_90, which needs no GPU, to catch errors only the compiler sees and to check that it uses no
float division or fused multiply-add (which would round differently from torch). On a CUDA
machine, ``pytest -m gpu`` compares the compiled kernel with torch in-process.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.sample.sampler import make_generator
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.rejection_sampler import (
    SpecDecodeMetadata,
    rejection_sample,
    rejection_verify_torch,
)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

# Sizes include a vocabulary larger than one kernel block (4096) to cover the blocked argmax.
VOCAB_SIZES = (5, 37, 300, 5000)
NUM_RANDOM_CASES = 24


def _random_params(g: torch.Generator) -> tuple[SamplingParams, bool]:
    choice = int(torch.randint(0, 6, (1,), generator=g))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(min_p=0.1),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.02),
    ][choice]
    seeded = bool(torch.randint(0, 2, (1,), generator=g))
    return params, seeded


def _random_case(seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    vocab = VOCAB_SIZES[seed % len(VOCAB_SIZES)]
    num_requests = int(torch.randint(1, 7, (1,), generator=g))
    counts = [0] * num_requests if seed % 6 == 5 else torch.randint(0, 5, (num_requests,), generator=g).tolist()
    params, seeds = [], []
    for row in range(num_requests):
        p, seeded = _random_params(g)
        params.append(p)
        seeds.append(1000 * seed + row if seeded else None)
    logits = torch.randn(sum(counts) + num_requests, vocab, generator=g) * 3
    batch = SamplingBatch.from_params(params, [None] * num_requests, "cpu")
    target = processed_probs(logits, batch.repeat_rows([k + 1 for k in counts]))
    # Drafts: mostly likely under the target (so runs of acceptance happen), some arbitrary.
    likely = torch.multinomial(target, 1, generator=g).squeeze(1)
    drafts, row = [], 0
    for k in counts:
        arbitrary = torch.randint(0, vocab, (k,), generator=g)
        pick = torch.rand(k, generator=g) < 0.8
        drafts.append(torch.where(pick, likely[row : row + k], arbitrary).tolist())
        row += k + 1
    meta = SpecDecodeMetadata.from_drafts(drafts, "cpu")
    mode = seed % 3
    if mode == 0:
        draft_probs = None
    elif mode == 1:
        draft_probs = torch.softmax(torch.randn(meta.total_draft_tokens, vocab, generator=g) * 2, dim=-1)
    else:
        draft_probs = target[meta.target_logits_indices].clone()  # draft == target: all accepted
    meta = SpecDecodeMetadata.from_drafts(drafts, device)
    return logits.to(device), meta, None if draft_probs is None else draft_probs.to(device), params, seeds


def _sample(backend: str, seed: int, logits, meta, draft_probs, params, seeds, device: str):
    torch.manual_seed(10_000 + seed)  # rows without a generator draw from the default one
    generators = [None if s is None else make_generator(s, device) for s in seeds]
    batch = SamplingBatch.from_params(params, generators, device)
    return rejection_sample(logits, meta, draft_probs, batch, backend=backend)


def _pinned_noise_cases(device: str):
    """Hand-made inputs with pre-drawn randomness: ties across and within kernel blocks, the
    residual fallback (q == p and u = 1 forces a rejection with an empty residual), bonus rows."""
    vocab = 5000
    cases = []
    # Ties in the race keys (weights 1): the lowest index must win, within and across blocks.
    probs = torch.zeros(4, vocab)
    probs[0, [4500, 10, 4097]] = 1.0 / 3  # request 0, draft row (draft 10 rejected by u = 1)
    probs[1, [3, 4]] = 0.5  # request 0, bonus row
    probs[2, [4999, 4096]] = 0.5  # request 1, draft row
    probs[3, [7, 4098]] = 0.5  # request 1, bonus row
    meta = SpecDecodeMetadata.from_drafts([[10], [4096]], device)
    cases.append((probs, meta, None, torch.tensor([1.0, 0.0]), torch.ones(2, vocab)))
    # Residual fallback: q == p at the rejected position.
    draft_probs = probs[[0, 2]].clone()
    cases.append((probs, meta, draft_probs, torch.tensor([1.0, 1.0]), torch.ones(2, vocab)))
    return [
        (p.to(device), m, None if q is None else q.to(device), u.to(device), w.to(device)) for p, m, q, u, w in cases
    ]


# Case 0: draft 10 fails (u = 1), the residual race ties 4097 and 4500 -> 4097; draft 4096 passes
# (u = 0) and the bonus race ties 7 and 4098 (different blocks) -> 7. Case 1: both drafts fail
# with an empty residual, so the race runs over p: 10 (ties 10, 4097, 4500) and 4096.
PINNED_EXPECTED = [[[4097, -1], [4096, 7]], [[10, -1], [4096, -1]]]


def compare_backends(device: str) -> list[str]:
    """Run every case through both backends; return a description of each disagreement."""
    from sonar_core.spec_decode.rejection_triton import rejection_verify_triton

    problems: list[str] = []
    seen = {"accepted_all": 0, "rejected": 0, "no_drafts": 0}
    for seed in range(NUM_RANDOM_CASES):
        logits, meta, draft_probs, params, seeds = _random_case(seed, device)
        reference = _sample("torch", seed, logits, meta, draft_probs, params, seeds, device)
        kernel = _sample("triton", seed, logits, meta, draft_probs, params, seeds, device)
        if reference != kernel:
            problems.append(f"case {seed}: torch {reference} != triton {kernel}")
        for k, a in zip(meta.num_draft_tokens, reference.num_accepted, strict=True):
            seen["no_drafts" if k == 0 else "accepted_all" if a == k else "rejected"] += 1
    for index, (probs, meta, draft_probs, uniforms, weights) in enumerate(_pinned_noise_cases(device)):
        reference = rejection_verify_torch(probs, meta, draft_probs, uniforms, weights)
        kernel = rejection_verify_triton(probs, meta, draft_probs, uniforms, weights)
        if not all(torch.equal(a, b) for a, b in zip(reference, kernel, strict=True)):
            problems.append(f"pinned case {index}: torch {reference} != triton {kernel}")
        if reference[0].tolist() != PINNED_EXPECTED[index]:
            problems.append(f"pinned case {index}: expected {PINNED_EXPECTED[index]}, got {reference[0].tolist()}")
    problems.extend(f"no case covered {name}" for name, count in seen.items() if count == 0)
    return problems


def compile_for_cuda() -> list[str]:
    """Compile the kernel for sm_90 without a GPU; return the float ops that could round differently.

    Identical rounding on both backends rests on the kernel using only exactly rounded float
    operations with nothing to fuse: no division (approximate in fast GPU paths) and no fused
    multiply-add.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sonar_core.spec_decode.rejection_triton import _rejection_kernel

    pointers = {"out_tokens_ptr": "*i64", "num_accepted_ptr": "*i64", "probs_ptr": "*fp32", "draft_ids_ptr": "*i64"}
    pointers |= {"draft_probs_ptr": "*fp32", "uniforms_ptr": "*fp32", "weights_ptr": "*fp32", "cu_num_draft_ptr": "*i64"}
    signature = {**pointers, "vocab_size": "i32", "out_stride": "i32", "HAS_DRAFT_PROBS": "constexpr", "BLOCK_V": "constexpr"}
    found = []
    for has_draft_probs in (True, False):
        source = ASTSource(
            fn=_rejection_kernel, signature=signature, constexprs={"HAS_DRAFT_PROBS": has_draft_probs, "BLOCK_V": 4096}
        )
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        found += re.findall(r"\b(?:div|fma)(?:\.\w+)*\.f32\b", ptx)
    return found


def _run_script(*args: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )


@needs_triton
def test_interpreted_triton_matches_torch() -> None:
    result = _run_script("compare", "cpu", interpret=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "agree" in result.stdout


@needs_triton
@pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton has no CUDA backend to compile for"
)
def test_kernel_compiles_for_cuda_without_inexact_float_ops() -> None:
    result = _run_script("compile", interpret=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled" in result.stdout


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_triton_matches_torch_on_cuda() -> None:
    assert compare_backends("cuda") == []


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        inexact = compile_for_cuda()
        if inexact:
            sys.exit(f"the compiled kernel uses {sorted(set(inexact))}")
        print("compiled for sm_90 with exactly rounded float ops only")
    else:
        mismatches = compare_backends(sys.argv[2])
        if mismatches:
            sys.exit("\n".join(mismatches))
        print("torch and triton agree on every case")
