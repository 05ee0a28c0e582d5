"""Random EAGLE heads for a target checkpoint, written in the published layouts.

Names, shapes and config keys follow the layouts as published (SafeAILab's EAGLE-1 and EAGLE-3
repositories, vllm-project/speculators), independently of Sonar's loader, so that a test of the
loader against these files checks it against the formats and not against itself::

    from sonar_core.testing.eagle_heads import build_eagle_head

    head = build_eagle_head(target_dir, tmp_path / "head", method="eagle3", layout="speculators",
                            draft_vocab_size=128)

The weights are random (``init_std`` like the tiny targets' weights, so that draft logits are
peaked); such heads draft tokens the target rarely accepts, which is what losslessness tests need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

from sonar_core.spec_decode.draft_layouts import (
    draft_layer_config,
    eagle3_speculators_config,
    save_draft_checkpoint,
    vocab_maps,
)
from sonar_core.testing.layer_tensors import layer_tensors

Layout = Literal["safeailab", "speculators"]


def build_eagle_head(
    target_dir: Path,
    out_dir: Path,
    *,
    method: Literal["eagle", "eagle3"] = "eagle3",
    layout: Layout = "speculators",
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    aux_layers: list[int] | None = None,
    include_embedding: bool = False,
    fc_bias: bool = True,
    norm_before_residual: bool = False,
    norm_output: bool = False,
    norm_before_fc: bool = False,
    fc_norm: bool = False,
    trained_depth: int = 3,
    verifier: str | None = None,
    init_std: float = 0.3,
    seed: int = 0,
) -> Path:
    """Write a random ``method`` head for the target in ``target_dir`` to ``out_dir``; returns it.

    ``method="eagle"`` writes SafeAILab's EAGLE-1 layout (``fc`` with a bias unless ``fc_bias`` is
    False; the first layer has no input norm). ``method="eagle3"`` writes SafeAILab's
    (``midlayer.*``) or speculators' (``layers.0.*``, ``transformer_layer_config``) layout.
    ``draft_vocab_size`` below the target's writes ``d2t``/``t2d`` for a random sorted subset of
    the target vocabulary. ``aux_layers`` (vLLM capture ids) default to EAGLE-3's (2, L/2, L-3)
    and are written to the config only in the speculators layout, unless given explicitly.
    """
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = json.loads((target_dir / "config.json").read_text())
    hidden = target["hidden_size"]
    vocab = target["vocab_size"]
    num_target_layers = target["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * init_std

    layer_config = draft_layer_config(target, num_layers)
    tensors: dict[str, torch.Tensor] = {}
    if method == "eagle":
        tensors["fc.weight"] = random(hidden, 2 * hidden)
        if fc_bias:
            tensors["fc.bias"] = random(hidden)
        for index in range(num_layers):
            tensors.update(layer_tensors(f"layers.{index}.", layer_config, hidden, random, input_norm=index > 0))
    else:
        first = "midlayer." if layout == "safeailab" else "layers.0."
        tensors.update(layer_tensors(first, layer_config, 2 * hidden, random, input_norm=True))
        tensors[first + "hidden_norm.weight"] = 1.0 + random(hidden) * 0.1
        for index in range(1, num_layers):
            tensors.update(layer_tensors(f"layers.{index}.", layer_config, hidden, random, input_norm=True))
        aux = aux_layers or [2, num_target_layers // 2, num_target_layers - 3]
        tensors["fc.weight"] = random(hidden, len(aux) * hidden)
        if norm_before_fc:
            tensors["input_norm.weight"] = 1.0 + random(len(aux) * hidden) * 0.1
        if fc_norm:
            for j in range(len(aux)):
                tensors[f"fc_norm.{j}.weight"] = 1.0 + random(hidden) * 0.1
        tensors["norm.weight"] = 1.0 + random(hidden) * 0.1
        draft_vocab = draft_vocab_size or vocab
        tensors["lm_head.weight"] = random(draft_vocab, hidden)
        if draft_vocab < vocab:
            tensors.update(vocab_maps(torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values, vocab))
    if include_embedding:
        tensors["embed_tokens.weight"] = random(vocab, hidden)
    config = _config(
        method, layout, layer_config, target, draft_vocab_size or vocab, aux_layers,
        dict(fc_bias=fc_bias, norm_before_residual=norm_before_residual, norm_output=norm_output,
             norm_before_fc=norm_before_fc, fc_norm=fc_norm),
        trained_depth, verifier or str(target_dir),
    )
    return save_draft_checkpoint(out_dir, tensors, config)


def _config(
    method: str,
    layout: Layout,
    layer_config: dict[str, Any],
    target: dict[str, Any],
    draft_vocab_size: int,
    aux_layers: list[int] | None,
    switches: dict[str, bool],
    trained_depth: int,
    verifier: str,
) -> dict[str, Any]:
    if method == "eagle":
        return {**layer_config, "architectures": ["LlamaForCausalLM"], "bias": switches["fc_bias"]}
    if layout == "safeailab":
        config = {**layer_config, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab_size}
        if aux_layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux_layers
        return config
    num_target_layers = target["num_hidden_layers"]
    return eagle3_speculators_config(
        layer_config,
        target,
        draft_vocab_size=draft_vocab_size,
        aux_layers=aux_layers or [2, num_target_layers // 2, num_target_layers - 3],
        trained_depth=trained_depth,
        verifier=verifier,
        norm_before_residual=switches["norm_before_residual"],
        norm_output=switches["norm_output"],
        norm_before_fc=switches["norm_before_fc"],
        fc_norm=switches["fc_norm"],
    )
