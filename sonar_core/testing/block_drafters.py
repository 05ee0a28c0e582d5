"""Random DFlash and DSpark drafters for a Qwen3 target, in the published layouts.

Names, shapes and config keys follow z-lab's DFlash, DeepSpec's DSpark and vllm-project/speculators,
independently of Sonar's loaders::

    from sonar_core.testing.block_drafters import build_block_drafter

    dflash = build_block_drafter(target_dir, tmp_path / "dflash", layout="zlab", block_size=4)
    dspark = build_block_drafter(target_dir, tmp_path / "dspark", layout="deepspec", markov_rank=8)
    embedded = build_block_drafter(target_dir, tmp_path / "target+dspark", layout="embedded")

``layout="embedded"`` writes a copy of the target whose checkpoint also holds DSpark weights under
``dspark.`` and whose config.json has a ``dspark_config`` entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

from sonar_core.spec_decode.draft_layouts import (
    dflash_zlab_config,
    draft_layer_config,
    save_draft_checkpoint,
    vocab_maps,
)
from sonar_core.testing.layer_tensors import copy_with_tensors, layer_tensors

Layout = Literal["zlab", "deepspec", "speculators-dflash", "speculators-dspark", "embedded"]


def build_block_drafter(
    target_dir: Path,
    out_dir: Path,
    *,
    layout: Layout = "zlab",
    num_layers: int = 1,
    block_size: int = 4,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    causal: bool = False,
    markov_rank: int = 0,
    markov_head_type: str = "vanilla",
    confidence_head: bool = False,
    draft_vocab_size: int | None = None,
    sample_from_anchor: bool | None = None,
    init_std: float = 0.3,
    seed: int = 0,
) -> Path:
    """Write a random block drafter for the Qwen3 target in ``target_dir`` to ``out_dir``.

    ``target_layer_ids`` are DFlash/DeepSpec ids (layer outputs; -1 the embeddings), written as
    capture ids (+1) in the speculators layouts; by default the first and the middle layer.
    ``mask_token_id`` defaults to the target's last token. DeepSpec and speculators drafters carry
    their own embedding and LM head (``draft_vocab_size`` below the vocabulary writes ``d2t`` in the
    speculators layouts); z-lab's and the embedded one use the target's.
    """
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = json.loads((target_dir / "config.json").read_text())
    hidden, vocab, layers = target["hidden_size"], target["vocab_size"], target["num_hidden_layers"]
    ids = target_layer_ids if target_layer_ids is not None else [0, layers // 2]
    mask = mask_token_id if mask_token_id is not None else vocab - 1
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * init_std

    layer_config = draft_layer_config(target, num_layers, layer_types=["full_attention"] * num_layers)
    tensors: dict[str, torch.Tensor] = {}
    for index in range(num_layers):
        tensors.update(layer_tensors(f"layers.{index}.", layer_config, hidden, random, input_norm=True))
    tensors["fc.weight"] = random(hidden, len(ids) * hidden) / (len(ids) * hidden) ** 0.5
    tensors["hidden_norm.weight"] = 1.0 + random(hidden) * 0.1
    tensors["norm.weight"] = 1.0 + random(hidden) * 0.1
    speculators = layout.startswith("speculators")
    draft_vocab = draft_vocab_size or vocab
    if layout in ("deepspec", "speculators-dflash", "speculators-dspark"):
        tensors["embed_tokens.weight"] = random(vocab, hidden)
        tensors["lm_head.weight"] = random(draft_vocab, hidden)
    if speculators and draft_vocab < vocab:
        tensors.update(vocab_maps(torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values, vocab))
    if markov_rank:
        tensors["markov_head.markov_w1.weight"] = random(vocab, markov_rank)
        tensors["markov_head.markov_w2.weight"] = random(draft_vocab, markov_rank) / markov_rank**0.5
        if markov_head_type == "gated":
            tensors["markov_head.gate_proj.weight"] = random(markov_rank, hidden + markov_rank)
            tensors["markov_head.gate_proj.bias"] = random(markov_rank)
        elif markov_head_type == "rnn":
            tensors["markov_head.joint_proj.weight"] = random(3 * markov_rank, 2 * markov_rank + hidden)
            tensors["markov_head.joint_proj.bias"] = random(3 * markov_rank)
    if confidence_head:
        tensors["confidence_head.proj.weight"] = random(1, hidden + markov_rank)
        tensors["confidence_head.proj.bias"] = random(1)
    dspark_fields = {
        "markov_rank": markov_rank,
        "markov_head_type": markov_head_type,
        "enable_confidence_head": confidence_head,
        "confidence_head_with_markov": bool(markov_rank),
    }
    if layout == "embedded":
        embedded = {f"dspark.{name}": tensor for name, tensor in tensors.items()}
        return copy_with_tensors(target_dir, out_dir, embedded, {"dspark_config": {
            "num_hidden_layers": num_layers, "block_size": block_size, "mask_token_id": mask,
            "target_layer_ids": ids, **dspark_fields,
        }})
    if layout == "zlab":
        config = dflash_zlab_config(
            layer_config, num_target_layers=layers, block_size=block_size, target_layer_ids=ids, mask_token_id=mask,
            causal=causal,
        )
    elif layout == "deepspec":
        config = {
            **layer_config, "architectures": ["Qwen3DSparkModel"], "num_target_layers": layers, "block_size": block_size,
            "mask_token_id": mask, "target_layer_ids": ids, "num_anchors": 512, **dspark_fields,
        }
    else:
        kind = "dflash" if layout == "speculators-dflash" else "dspark"
        anchor = sample_from_anchor if sample_from_anchor is not None else kind == "dspark"
        config = {
            "speculators_model_type": kind,
            "architectures": ["DFlashSpeculator" if kind == "dflash" else "DSparkSpeculator"],
            "transformer_layer_config": layer_config,
            "draft_vocab_size": draft_vocab,
            "block_size": block_size,
            "target_hidden_size": None,
            "aux_hidden_state_layer_ids": [i + 1 for i in ids],
            "mask_token_id": mask,
            "sample_from_anchor": anchor,
            **(dspark_fields if kind == "dspark" else {}),
            "speculators_config": {
                "algorithm": kind,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size - (0 if anchor else 1)}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": str(target_dir), "architectures": list(target.get("architectures") or [])},
            },
        }
    return save_draft_checkpoint(out_dir, tensors, config)
