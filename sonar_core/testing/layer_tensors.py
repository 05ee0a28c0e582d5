"""Random tensors of one Llama-family decoder layer in Hugging Face names, for the test kit's
draft-checkpoint builders (EAGLE, DFlash, DSpark heads and MTP layers are made of such layers), and
a copy of a target checkpoint with draft tensors added (weights a target ships for a proposer)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def layer_tensors(
    prefix: str, config: dict[str, Any], input_size: int, random: Callable[..., torch.Tensor], input_norm: bool
) -> dict[str, torch.Tensor]:
    """One Llama-family decoder layer in Hugging Face names (q/k/v read ``input_size`` values)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    qkv_bias = config.get("model_type") == "qwen2" or bool(config.get("attention_bias"))
    tensors = {
        f"{prefix}self_attn.q_proj.weight": random(heads * head_dim, input_size),
        f"{prefix}self_attn.k_proj.weight": random(kv_heads * head_dim, input_size),
        f"{prefix}self_attn.v_proj.weight": random(kv_heads * head_dim, input_size),
        f"{prefix}self_attn.o_proj.weight": random(hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": random(inter, hidden),
        f"{prefix}mlp.up_proj.weight": random(inter, hidden),
        f"{prefix}mlp.down_proj.weight": random(hidden, inter),
        f"{prefix}post_attention_layernorm.weight": 1.0 + random(hidden) * 0.1,
    }
    if input_norm:
        tensors[f"{prefix}input_layernorm.weight"] = 1.0 + random(hidden) * 0.1
    if qkv_bias:
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            tensors[f"{prefix}self_attn.{name}_proj.bias"] = random(rows * head_dim)
    if config.get("model_type") == "qwen3":
        tensors[f"{prefix}self_attn.q_norm.weight"] = 1.0 + random(head_dim) * 0.1
        tensors[f"{prefix}self_attn.k_norm.weight"] = 1.0 + random(head_dim) * 0.1
    return tensors


def copy_with_tensors(
    target_dir: Path, out_dir: Path, tensors: dict[str, torch.Tensor], config_updates: dict[str, Any]
) -> Path:
    """A copy of a single-file checkpoint with ``tensors`` added to its weights and
    ``config_updates`` merged into its config.json; returns ``out_dir``."""
    shutil.copytree(target_dir, out_dir)
    weights = load_file(out_dir / "model.safetensors")
    weights.update({name: tensor.contiguous() for name, tensor in tensors.items()})
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config.update(config_updates)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
