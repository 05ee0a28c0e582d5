"""Losslessness checks a speculation method proves itself with, in a few lines of its own tests.

- :func:`greedy_outputs`: greedy outputs (float32) of the target with and without speculation, to
  compare token for token.
- :func:`constant_distribution_target`: a target whose next-token distribution is the same at
  every position (every token embeds to one vector, every layer adds nothing), so sampled outputs
  are i.i.d. draws of a known distribution and a draft head can be made to draft from exactly it.
- :func:`sampled_output_distances`: sample many short requests and measure how far each output
  position (and a pair of positions) lies from the target distribution, against the
  distribution-free bound of Weissman et al. (2003): a correct engine exceeds a bound with
  probability at most ``delta`` (1e-6).
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

DELTA = 1e-6


def random_prompts(count: int, seed: int, vocab: int = 512, max_len: int = 40) -> list[list[int]]:
    """``count`` seeded prompts of 2..``max_len`` token ids in ``3..vocab-1`` (above the special
    ids of the test kit's tokenizer): the mix of lengths the losslessness tests run."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, max_len))] for _ in range(count)]


def l1_bound(samples: int, categories: int, delta: float = DELTA) -> float:
    """The L1 distance a correct sampler exceeds with probability at most ``delta``."""
    return math.sqrt(2.0 * (math.log(2.0**categories - 2.0) - math.log(delta)) / samples)


def greedy_outputs(
    target: Path, prompts: list[list[int]], speculative_config: dict[str, Any] | None = None,
    max_tokens: int = 20, **engine: Any,
) -> tuple[list[list[int]], Any]:
    """Greedy output token ids (float32, CPU) and the LLM, after checking that no KV block leaked."""
    from sonar_core.entrypoints.llm import LLM
    from sonar_core.sampling_params import SamplingParams

    llm = LLM(model=str(target), dtype="float32", device="cpu", speculative_config=speculative_config, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outputs], llm


def outputs_with_aborts(
    engine: Any, prompts: list[list[int]], params: Any, aborted: set[int], abort_at_step: int, max_steps: int = 200
) -> tuple[dict[int, list[int]], bool]:
    """Run ``prompts`` through ``engine`` step by step and abort the requests at the indices in
    ``aborted`` at step ``abort_at_step``; the other requests' output token ids by prompt index,
    and whether every KV block came back once all ended."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    index_of = {request_id: i for i, request_id in enumerate(ids)}
    finished: dict[int, list[int]] = {}
    for step in range(max_steps):
        if step == abort_at_step:
            for i in sorted(aborted):
                engine.abort_request(ids[i])
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                finished[index_of[out.request_id]] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    manager = engine.block_manager
    return finished, manager.num_free_blocks == manager.num_blocks


def constant_distribution_target(target_dir: Path, out_dir: Path, token: int = 7) -> Path:
    """A copy of a Llama-family checkpoint whose every position has the same next-token distribution.

    Every token embeds to token ``token``'s vector and every layer's output projections
    (``o_proj``, ``down_proj``) are zero, so the residual stream is that vector at every position.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in Path(target_dir).iterdir():
        if item.is_file():
            shutil.copy2(item, out_dir / item.name)
    tensors = load_file(Path(target_dir) / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed[token].expand_as(embed).clone()
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def probabilistic_llm(target: Path, speculative_config: dict[str, Any]) -> Any:
    """An LLM (float32, CPU, 256 requests a step) drafting with ``draft_sample_method: probabilistic``."""
    from sonar_core.entrypoints.llm import LLM

    config = {**speculative_config, "draft_sample_method": "probabilistic"}
    return LLM(model=str(target), dtype="float32", device="cpu", max_num_seqs=256, speculative_config=config)


def per_position_acceptance(llm: Any, depth: int, top_k: int = 4) -> list[float]:
    """Acceptance rate per draft position over a few seeded sampled requests long enough for full
    drafts: a draft that samples exactly the target's distribution gets 1.0 at every position."""
    from sonar_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=1 + 5 * (depth + 1), seed=1, ignore_eos=True)
    llm.generate([[5, 9, 12], [40, 41], [100]], params, use_tqdm=False)
    return llm.get_spec_decode_metrics().per_position_acceptance_rate


def target_logits(llm: Any) -> torch.Tensor:
    """``[V]`` float32 logits of a :func:`constant_distribution_target` (any position)."""
    model = llm.engine.model
    with torch.inference_mode():
        hidden = model.model.norm(model.model.embed_tokens.weight[:1])
        return model.compute_logits(hidden)[0]


def sampled_output_distances(
    llm: Any, top_k: int = 4, samples: int = 3000, max_tokens: int = 4
) -> dict[str, tuple[float, float]]:
    """Sample ``samples`` requests of ``max_tokens`` tokens at temperature 1 and top-k ``top_k``
    from a :func:`constant_distribution_target`; L1 distance and bound of each checked distribution.

    Every position's token (sampled, drafted and accepted, recovered or bonus) must follow the
    target's processed distribution ``p``, and positions 1 and 2 (one verification step) must be
    independent draws (their joint is ``p x p``).
    """
    from sonar_core.sample.processing import SamplingBatch, processed_probs
    from sonar_core.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=max_tokens, ignore_eos=True)
    p = processed_probs(target_logits(llm)[None], SamplingBatch.from_params([params], [None], "cpu"))[0].double()
    support = torch.nonzero(p).squeeze(1)
    if len(support) != top_k:
        raise AssertionError(f"the target distribution has {len(support)} tokens in its top-{top_k}")
    outputs = llm.generate([[3 + i % 50] for i in range(samples)], params, use_tqdm=False)
    index = {int(token): i for i, token in enumerate(support)}
    local = torch.tensor([[index[t] for t in o.outputs[0].token_ids] for o in outputs])
    expected = p[support]
    results = {}
    for position in range(1, max_tokens):
        empirical = torch.bincount(local[:, position], minlength=top_k).double() / samples
        results[f"position {position}"] = (float((empirical - expected).abs().sum()), l1_bound(samples, top_k))
    joint = torch.bincount(local[:, 1] * top_k + local[:, 2], minlength=top_k * top_k).double() / samples
    results["positions 1-2"] = (
        float((joint - torch.outer(expected, expected).flatten()).abs().sum()),
        l1_bound(samples, top_k * top_k),
    )
    return results


def assert_follows_target_distribution(results: dict[str, tuple[float, float]]) -> None:
    for name, (distance, bound) in results.items():
        assert distance < bound, f"{name}: L1 {distance:.4f} >= bound {bound:.4f}"
