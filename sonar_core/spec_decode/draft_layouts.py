"""Writing draft checkpoints in the published layouts: config.json contents, vocabulary maps, files.

The counterpart of the readers (:mod:`~sonar_core.spec_decode.speculators_format`, the plugins'
layouts): what a checkpoint of each layout holds besides its weights, written from the published
formats (FORMATS.md; vllm-project/speculators, vLLM's MedusaConfig, IBM's fms-extras, z-lab's
DFlash) and not from Sonar's loaders, so that a file written here checks the loaders against the
formats. The trainer (``aphrodite train-draft``) writes its heads with it and the test kit
(:mod:`sonar_core.testing`) its random heads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# Keys of a target's config.json that describe the checkpoint, not its layers.
_CHECKPOINT_KEYS = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version")


def draft_layer_config(
    target_config: Mapping[str, Any], num_layers: int, layer_types: Sequence[str] | None = None, **overrides: Any
) -> dict[str, Any]:
    """The config of ``num_layers`` draft layers shaped like the target's (its ``model_type``,
    sizes, RoPE), untied; ``layer_types`` replaces the target's list; ``overrides`` set any key
    (``intermediate_size`` for a narrower MLP, ``model_type`` for another layer family)."""
    config = {key: value for key, value in target_config.items() if key not in _CHECKPOINT_KEYS}
    config.update(num_hidden_layers=num_layers, tie_word_embeddings=False)
    if config.get("layer_types"):
        config["layer_types"] = list(layer_types) if layer_types is not None else config["layer_types"][:num_layers]
    config.update(overrides)
    return config


def vocab_maps(used_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """``d2t`` (int64 offsets: target id = draft id + d2t) and ``t2d`` (bool mask over the target
    vocabulary) of a draft vocabulary made of the target ids ``used_ids``, which must be sorted
    ascending and distinct (FORMATS.md 2.3)."""
    used = used_ids.to(torch.int64)
    if used.dim() != 1 or (used.numel() > 1 and not bool((used[1:] > used[:-1]).all())):
        raise ValueError("used_ids must be a 1-D tensor of distinct target ids in ascending order")
    if used.numel() and (int(used[0]) < 0 or int(used[-1]) >= vocab_size):
        raise ValueError(f"used_ids must lie in 0..{vocab_size - 1}")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return {"d2t": used - torch.arange(used.numel()), "t2d": t2d}


def eagle3_speculators_config(
    layer_config: Mapping[str, Any],
    target_config: Mapping[str, Any],
    *,
    draft_vocab_size: int,
    aux_layers: Sequence[int],
    trained_depth: int,
    verifier: str,
    norm_before_residual: bool = False,
    norm_output: bool = False,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
) -> dict[str, Any]:
    """vllm-project/speculators' EAGLE-3 ``config.json`` (FORMATS.md 2.2); ``aux_layers`` are
    vLLM capture ids, ``trained_depth`` the draft length it was trained for."""
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": dict(layer_config),
        "draft_vocab_size": draft_vocab_size,
        "norm_before_residual": norm_before_residual,
        "norm_output": norm_output,
        "norm_before_fc": norm_before_fc,
        "fc_norm": fc_norm,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "speculators_version": "0.3.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": trained_depth, "verifier_accept_k": 1,
                 "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(target_config.get("architectures") or [])},
        },
    }


def medusa_config(
    *,
    hidden_size: int,
    vocab_size: int,
    num_heads: int,
    num_layers: int,
    truncated_vocab_size: int,
    fc_bias: bool,
    original_lm_head: bool = False,
) -> dict[str, Any]:
    """vLLM's MedusaConfig ``config.json`` (FORMATS.md 3.2): ``lm_heads.{h}`` score
    ``truncated_vocab_size`` tokens (a ``token_map`` names them when that is below the vocabulary);
    ``original_lm_head`` makes ``lm_heads.0`` the one LM head of every head."""
    config: dict[str, Any] = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "num_heads": num_heads,
        "num_hidden_layers": num_layers,
        "truncated_vocab_size": truncated_vocab_size,
        "medusa_fc_bias": fc_bias,
        "max_paths": 64,
        "topk": 10,
    }
    if original_lm_head:
        config["original_lm_head"] = True
    return config


def mlp_speculator_config(
    *, vocab_size: int, emb_dim: int, inner_dim: int, n_predict: int, tie_weights: bool, scale_input: bool
) -> dict[str, Any]:
    """IBM fms-extras' MLP speculator ``config.json`` (FORMATS.md 4.1); ``inner_dim`` 0 means
    ``emb_dim``."""
    return {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": vocab_size,
        "emb_dim": emb_dim,
        "inner_dim": inner_dim,
        "n_predict": n_predict,
        "top_k_tokens_per_head": [1] * n_predict,
        "n_candidates": 1,
        "tie_weights": tie_weights,
        "scale_input": scale_input,
    }


def dflash_zlab_config(
    layer_config: Mapping[str, Any],
    *,
    num_target_layers: int,
    block_size: int,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    causal: bool = False,
) -> dict[str, Any]:
    """z-lab's DFlash ``config.json`` (FORMATS.md 6.1): the draft layers' config plus
    ``dflash_config``; ``target_layer_ids`` are layer outputs (vLLM capture id - 1)."""
    return {
        **layer_config,
        "architectures": ["DFlashDraftModel"],
        "num_target_layers": num_target_layers,
        "block_size": block_size,
        "dflash_config": {
            "target_layer_ids": list(target_layer_ids),
            "mask_token_id": mask_token_id,
            "block_size": block_size,
            "causal": causal,
        },
    }


def save_draft_checkpoint(out_dir: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    """Write ``model.safetensors`` and ``config.json`` to ``out_dir`` (created); returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
