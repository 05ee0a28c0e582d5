"""Targets that carry random MTP layers, in the published layouts (FORMATS.md section 5).

Names and config keys follow the published checkpoints, independently of Sonar's loaders::

    from sonar_core.testing.mtp_layers import build_mimo_target

    base = build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2")
    mimo = build_mimo_target(base, tmp_path / "mimo", num_mtp_layers=1)

``build_mimo_target`` copies a Qwen2 (or bias-free Llama) checkpoint into a MiMo-7B one: architecture
``MiMoForCausalLM``, model_type ``mimo``, ``num_nextn_predict_layers``, and per MTP layer
``model.mtp_layers.{i}.`` with ``token_layernorm``, ``hidden_layernorm``, ``input_proj`` [H, 2H],
``final_layernorm`` and a Qwen2 decoder layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sonar_core.testing.layer_tensors import copy_with_tensors, layer_tensors

MIMO_PREFIX = "model.mtp_layers."


def mimo_layer_tensors(config: dict, index: int, random) -> dict[str, torch.Tensor]:
    """The tensors of MiMo MTP layer ``index`` for a Qwen2 ``config`` (config.json as a dict)."""
    hidden = config["hidden_size"]
    prefix = f"{MIMO_PREFIX}{index}."
    tensors = layer_tensors(prefix, {**config, "model_type": "qwen2"}, hidden, random, input_norm=True)
    tensors[f"{prefix}token_layernorm.weight"] = 1.0 + random(hidden) * 0.1
    tensors[f"{prefix}hidden_layernorm.weight"] = 1.0 + random(hidden) * 0.1
    tensors[f"{prefix}input_proj.weight"] = random(hidden, 2 * hidden) / (2 * hidden) ** 0.5
    tensors[f"{prefix}final_layernorm.weight"] = 1.0 + random(hidden) * 0.1
    return tensors


def build_mimo_target(
    base_dir: Path, out_dir: Path, *, num_mtp_layers: int = 1, init_std: float = 0.3, seed: int = 0
) -> Path:
    """A MiMo-7B-style copy of the Qwen2 or Llama checkpoint in ``base_dir`` with ``num_mtp_layers``
    random MTP layers; returns ``out_dir``. A Llama checkpoint (without attention or MLP biases)
    gets zero q/k/v biases: as a Qwen2 model it computes the same function, so a benchmark can
    compare MTP on it with the original model's plain decoding."""
    base_dir = Path(base_dir)
    config = json.loads((base_dir / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in ("qwen2", "llama") or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{base_dir}: MiMo targets are Qwen2 models; a {model_type!r} checkpoint cannot become one")
    generator = torch.Generator().manual_seed(seed)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * init_std

    tensors: dict[str, torch.Tensor] = {}
    if model_type == "llama":
        tensors.update(_zero_qkv_biases(config))
    for index in range(num_mtp_layers):
        tensors.update(mimo_layer_tensors(config, index, random))
    updates = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_nextn_predict_layers": num_mtp_layers}
    return copy_with_tensors(base_dir, Path(out_dir), tensors, updates)


def _zero_qkv_biases(config: dict) -> dict[str, torch.Tensor]:
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rows = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    return {
        f"model.layers.{layer}.self_attn.{name}_proj.bias": torch.zeros(count)
        for layer in range(config["num_hidden_layers"])
        for name, count in rows.items()
    }


DEEPSEEK_MTP_OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


def build_deepseek_target(out_dir: Path, *, num_layers: int = 2, seed: int = 0, init_std: float = 0.3, **kwargs) -> Path:
    """A tiny DeepSeek-V3 checkpoint with one MTP layer under ``model.layers.{num_layers}.``.

    transformers never writes MTP layers, so a model of ``num_layers + 1`` layers is saved and its
    last layer becomes the MTP layer's decoder block (an MoE layer, as in DeepSeek-V3), with
    ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm`` and the copies of the
    embedding and LM head the published checkpoints carry (``embed_tokens``, ``shared_head.head``).
    The full model stays in ``out_dir.with_name(out_dir.name + "-full")`` (a test's oracle reads
    the MTP block's weights from it). ``kwargs`` go to ``build_tiny_checkpoint``.
    """
    from safetensors.torch import load_file, save_file

    from sonar_core.testing.checkpoints import build_tiny_checkpoint

    out_dir = Path(out_dir)
    full = build_tiny_checkpoint(
        out_dir.with_name(out_dir.name + "-full"), "deepseek_v3", num_layers=num_layers + 1, seed=seed,
        init_std=init_std, **kwargs,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in full.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            (out_dir / item.name).write_bytes(item.read_bytes())
    tensors = load_file(full / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(seed + 1)
    prefix = f"model.layers.{num_layers}."
    tensors[f"{prefix}enorm.weight"] = 1.0 + torch.randn(hidden, generator=generator) * 0.1
    tensors[f"{prefix}hnorm.weight"] = 1.0 + torch.randn(hidden, generator=generator) * 0.1
    tensors[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * init_std / (2 * hidden) ** 0.5
    tensors[f"{prefix}shared_head.norm.weight"] = 1.0 + torch.randn(hidden, generator=generator) * 0.1
    tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((full / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


QWEN3_NEXT_MTP_OWN = ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def build_qwen3_next_target(
    out_dir: Path, *, num_layers: int = 4, seed: int = 0, init_std: float = 0.3, **kwargs
) -> Path:
    """A tiny Qwen3-Next checkpoint with one MTP layer under ``mtp.`` (FORMATS.md 5.3).

    transformers never writes MTP layers, so a model of ``num_layers + 1`` layers is saved whose
    last layer is a full-attention layer with the sparse MoE; it becomes ``mtp.layers.0.*``, next
    to ``mtp.fc`` [H, 2H], ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` and
    ``mtp.norm`` (zero-centred, like every Qwen3-Next norm). The first ``num_layers`` layers
    alternate linear and full attention, ending on full attention. The full model stays in
    ``out_dir.with_name(out_dir.name + "-full")``. ``kwargs`` go to ``build_tiny_checkpoint``.
    """
    from safetensors.torch import load_file, save_file

    from sonar_core.testing.checkpoints import build_tiny_checkpoint

    out_dir = Path(out_dir)
    kinds = ["linear_attention", "full_attention"] * num_layers
    overrides = {"layer_types": [*kinds[:num_layers], "full_attention"], **kwargs.pop("config_overrides", {})}
    full = build_tiny_checkpoint(
        out_dir.with_name(out_dir.name + "-full"), "qwen3_next", num_layers=num_layers + 1, seed=seed,
        init_std=init_std, config_overrides=overrides, **kwargs,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in full.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json"):
            (out_dir / item.name).write_bytes(item.read_bytes())
    tensors = load_file(full / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(seed + 1)
    last = f"model.layers.{num_layers}."
    tensors = {(f"mtp.layers.0.{name[len(last):]}" if name.startswith(last) else name): value
               for name, value in tensors.items()}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=generator) * 0.1
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * init_std / (2 * hidden) ** 0.5
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((full / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, num_nextn_predict_layers=1, layer_types=overrides["layer_types"][:num_layers])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def build_gemma4_assistant(
    target_dir: Path,
    out_dir: Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 32,
    ordered_embeddings: bool = False,
    num_centroids: int = 16,
    top_k_centroids: int = 4,
    init_std: float = 0.3,
    seed: int = 0,
) -> Path:
    """A random Gemma 4 assistant (``Gemma4AssistantForCausalLM``, saved by transformers) for the
    Gemma 4 target in ``target_dir``: query-only layers alternating sliding and full attention
    with the target's head sizes, KV heads, window and rope; ``ordered_embeddings`` adds the
    centroid-masked LM head with a random token ordering."""
    from transformers import AutoConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    target = AutoConfig.from_pretrained(target_dir, local_files_only=True).get_text_config(decoder=True)
    kinds = ["sliding_attention", "full_attention"] * num_layers
    sliding = target.per_layer_config[target.layer_types.index("sliding_attention")]
    full = target.per_layer_config[target.layer_types.index("full_attention")]
    text = {
        key: getattr(target, key)
        for key in ("vocab_size", "num_attention_heads", "sliding_window", "rope_parameters", "rms_norm_eps",
                    "hidden_activation", "max_position_embeddings")
    }
    text.update(
        model_type="gemma4_text", hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        layer_types=kinds[:num_layers], head_dim=sliding.head_dim, num_key_value_heads=sliding.num_key_value_heads,
        global_head_dim=full.head_dim, num_global_key_value_heads=full.num_key_value_heads,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, initializer_range=init_std,
    )
    config = Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=target.hidden_size, use_ordered_embeddings=ordered_embeddings,
        num_centroids=num_centroids, centroid_intermediate_top_k=top_k_centroids, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):  # transformers starts them at 1
                param.mul_(1.0 + 0.25 * (torch.rand(param.shape, generator=generator) * 2 - 1))
        if ordered_embeddings:
            model.masked_embedding.token_ordering.copy_(torch.randperm(target.vocab_size, generator=generator))
    model.save_pretrained(out_dir)
    return Path(out_dir)
