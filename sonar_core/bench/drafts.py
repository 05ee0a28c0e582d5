"""Same-vocabulary draft checkpoints for benchmarks: the target's first N decoder layers.

No packaged model shares SmolLM2's vocabulary, so a layer-truncated copy of the target is the
draft the draft-model rows use (Sonar's ``draft_model`` and transformers' ``assistant_model``
alike). It is built once per target and depth under ``$SONAR_CACHE_DIR/bench/drafts``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sonar_core.models.gguf import cache_root


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
