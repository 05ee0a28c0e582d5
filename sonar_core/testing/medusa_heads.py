"""Random Medusa heads and MLP speculators for a target checkpoint, in the published layouts.

Names, shapes and config keys follow the published formats (FasterDecoding/Medusa, vLLM's
MedusaConfig, IBM's fms-extras MLP speculator) independently of Sonar's loaders::

    from sonar_core.testing.medusa_heads import build_medusa_head, build_mlp_speculator

    medusa = build_medusa_head(target_dir, tmp_path / "medusa", layout="vllm", num_heads=3)
    mlp = build_mlp_speculator(target_dir, tmp_path / "mlp", n_predict=3)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

from sonar_core.spec_decode.draft_layouts import medusa_config, mlp_speculator_config, save_draft_checkpoint


def _random(generator: torch.Generator, std: float):
    return lambda *shape: torch.randn(*shape, generator=generator) * std


def build_medusa_head(
    target_dir: Path,
    out_dir: Path,
    *,
    layout: Literal["vllm", "fasterdecoding"] = "vllm",
    num_heads: int = 3,
    num_layers: int = 1,
    truncated_vocab_size: int | None = None,
    fc_bias: bool = True,
    config_num_heads: int | None = None,
    init_std: float = 0.3,
    seed: int = 0,
) -> Path:
    """Write random Medusa heads for the target in ``target_dir`` to ``out_dir``; returns it.

    ``layout="fasterdecoding"`` writes FasterDecoding's ``config.json`` (``medusa_num_heads``,
    ``medusa_num_layers``, ``base_model_name_or_path``) and ``medusa_lm_head.pt`` (keys
    ``{h}.{l}.linear.weight/bias`` and ``{h}.{L}.weight``); ``config_num_heads`` lets the config
    state another head count than the weights hold, as the published upload does.
    ``layout="vllm"`` writes vLLM's MedusaConfig layout (``blocks.{h}.layers.{l}``,
    ``lm_heads.{h}``, ``token_map`` for a ``truncated_vocab_size``) as safetensors.
    """
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = json.loads((target_dir / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    random = _random(generator, init_std)
    if layout == "fasterdecoding":
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {}
        for h in range(num_heads):
            for layer in range(num_layers):
                state[f"{h}.{layer}.linear.weight"] = random(hidden, hidden) / hidden**0.5
                state[f"{h}.{layer}.linear.bias"] = random(hidden) * 0.1
            state[f"{h}.{num_layers}.weight"] = random(vocab, hidden)
        torch.save(state, out_dir / "medusa_lm_head.pt")
        config = {
            "medusa_num_heads": config_num_heads or num_heads,
            "medusa_num_layers": num_layers,
            "base_model_name_or_path": str(target_dir),
        }
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out_dir
    draft_vocab = truncated_vocab_size or vocab
    tensors = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            tensors[f"blocks.{h}.layers.{layer}.weight"] = random(hidden, hidden) / hidden**0.5
            if fc_bias:
                tensors[f"blocks.{h}.layers.{layer}.bias"] = random(hidden) * 0.1
        tensors[f"lm_heads.{h}.weight"] = random(draft_vocab, hidden)
    if draft_vocab < vocab:
        tensors["token_map"] = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    config = medusa_config(
        hidden_size=hidden, vocab_size=vocab, num_heads=config_num_heads or num_heads, num_layers=num_layers,
        truncated_vocab_size=draft_vocab, fc_bias=fc_bias,
    )
    return save_draft_checkpoint(out_dir, tensors, config)


def build_mlp_speculator(
    target_dir: Path,
    out_dir: Path,
    *,
    n_predict: int = 3,
    inner_dim: int = 0,
    tie_weights: bool = False,
    scale_input: bool = False,
    prefix: str = "speculator.",
    write_tied_copies: bool = False,
    init_std: float = 0.3,
    seed: int = 0,
) -> Path:
    """Write a random IBM MLP speculator for the target in ``target_dir``; returns ``out_dir``.

    Tensors ``{prefix}emb.{i}``, ``proj.{i}``, ``head.{i}``, ``ln.{i}.weight/bias``; with
    ``tie_weights`` only the shared ones (index 0, and ``proj.1``) unless ``write_tied_copies``
    writes every index as a copy.
    """
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = json.loads((target_dir / "config.json").read_text())
    emb_dim, vocab = target["hidden_size"], target["vocab_size"]
    inner = inner_dim or emb_dim
    generator = torch.Generator().manual_seed(seed)
    random = _random(generator, init_std)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(n_predict):
        tied = tie_weights and not write_tied_copies
        if not tied or i == 0:
            tensors[f"{prefix}emb.{i}.weight"] = random(vocab, inner)
            tensors[f"{prefix}head.{i}.weight"] = random(vocab, inner) / inner**0.5
            tensors[f"{prefix}ln.{i}.weight"] = 1.0 + random(inner) * 0.1
            tensors[f"{prefix}ln.{i}.bias"] = random(inner) * 0.1
        if not tied or i <= 1:
            width = emb_dim if i == 0 else inner
            tensors[f"{prefix}proj.{i}.weight"] = random(inner, width) / width**0.5
    if tie_weights and write_tied_copies:  # every index holds the shared tensor
        for i in range(1, n_predict):
            for kind in ("emb", "head", "ln"):
                for leaf in ("weight", "bias") if kind == "ln" else ("weight",):
                    tensors[f"{prefix}{kind}.{i}.{leaf}"] = tensors[f"{prefix}{kind}.0.{leaf}"]
            if i >= 2:
                tensors[f"{prefix}proj.{i}.weight"] = tensors[f"{prefix}proj.1.weight"]
    config = mlp_speculator_config(
        vocab_size=vocab, emb_dim=emb_dim, inner_dim=inner_dim, n_predict=n_predict, tie_weights=tie_weights,
        scale_input=scale_input,
    )
    # Tied copies are stored as tensors of their own (safetensors refuses shared storage).
    return save_draft_checkpoint(out_dir, {name: tensor.clone() for name, tensor in tensors.items()}, config)
