"""Draft checkpoints for benchmarks, built once per target under ``$SONAR_CACHE_DIR/bench``.

- Truncated drafts: no packaged model shares SmolLM2's vocabulary, so a layer-truncated copy of
  the target is the draft the draft-model rows use (Sonar's ``draft_model`` and transformers'
  ``assistant_model`` alike).
- Random EAGLE heads: a head of the published layout with random weights. Its acceptance means
  nothing, but its cost per draft step is that of a trained head of the same shape, which is what
  the ``draft cost`` column measures before a trained head exists.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sonar_core.model_files import cache_root


def truncated_draft(target_dir: Path, num_layers: int, root: Path | None = None) -> Path:
    """The folder of the draft made of ``target_dir``'s first ``num_layers`` layers, built if missing."""
    from sonar_core.testing.checkpoints import build_truncated_draft

    root = root if root is not None else cache_root() / "bench" / "drafts"
    folder = root / Path(target_dir).name / f"first{num_layers}layers"  # the last part names the row
    if not (folder / "config.json").is_file():
        # Built aside and renamed, so an interrupted build is never taken for a finished one.
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        build_truncated_draft(Path(target_dir), partial, num_layers)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return folder


def random_head(
    target_dir: Path, method: str, draft_vocab_size: int, verifier: str, root: Path | None = None
) -> Path:
    """A random head of ``method`` for ``target_dir``, built if missing: one-layer EAGLE-1 (SafeAILab
    layout) for ``eagle``; one-layer EAGLE-3 (speculators layout, ``draft_vocab_size`` tokens,
    naming ``verifier``) for ``eagle3``; three one-layer Medusa heads (vLLM layout) for ``medusa``;
    a three-stage MLP speculator for ``mlp_speculator``; a one-layer block drafter of 8 slots (z-lab
    layout) for ``dflash`` and with a vanilla Markov head (DeepSpec layout) for ``dspark``; for
    ``mtp``, a MiMo-style copy of the target with one random MTP layer (a Llama target becomes the
    equivalent Qwen2 model). Medusa, MLP and DSpark heads score the full vocabulary, as their
    published checkpoints do."""
    from sonar_core.testing.block_drafters import build_block_drafter
    from sonar_core.testing.eagle_heads import build_eagle_head
    from sonar_core.testing.medusa_heads import build_medusa_head, build_mlp_speculator
    from sonar_core.testing.mtp_layers import build_mimo_target

    root = root if root is not None else cache_root() / "bench" / "heads"
    suffix = f"-v{draft_vocab_size}" if method == "eagle3" else ""
    folder = root / Path(target_dir).name / f"random-{method}{suffix}"
    if not (folder / "config.json").is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        target = Path(target_dir)
        if method == "eagle3":
            build_eagle_head(target, partial, method="eagle3", layout="speculators",
                             draft_vocab_size=draft_vocab_size, init_std=0.02, verifier=verifier)
        elif method == "eagle":
            build_eagle_head(target, partial, method="eagle", layout="safeailab", init_std=0.02)
        elif method == "medusa":
            build_medusa_head(target, partial, layout="vllm", num_heads=3, init_std=0.02)
        elif method == "dflash":
            build_block_drafter(target, partial, layout="zlab", block_size=8, init_std=0.02)
        elif method == "mtp":
            build_mimo_target(target, partial, init_std=0.02)
        elif method == "dspark":
            build_block_drafter(target, partial, layout="deepspec", block_size=8, markov_rank=256, init_std=0.02)
        else:
            build_mlp_speculator(target, partial, n_predict=3, init_std=0.02)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return folder
