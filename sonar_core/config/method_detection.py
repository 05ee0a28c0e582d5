"""Which method a draft checkpoint is for, when the configuration names a model but no method.

The rules follow what users of vLLM's configurations expect (an explicit method always wins):
a speculators-format config says it in ``speculators_model_type``; otherwise the checkpoint's
name and config decide (``eagle3`` and ``eagle-`` in the name, DFlash and DSpark names or
architectures, Medusa and MLP-speculator model types); anything else is a generic draft model.
"""

from __future__ import annotations

from sonar_core.config.target import TargetInfo

# Draft architectures that only one method loads.
_ARCHITECTURE_METHODS = {
    "DFlashDraftModel": "dflash",
    "DFlashSpeculator": "dflash",
    "Qwen3DSparkModel": "dspark",
    "Gemma4DSparkModel": "dspark",
    "DSparkSpeculator": "dspark",
    "Eagle3Speculator": "eagle3",
    "Eagle3LlamaForCausalLM": "eagle3",
    "LlamaForCausalLMEagle3": "eagle3",
    "EagleLlamaForCausalLM": "eagle",
}
_MODEL_TYPE_METHODS = {"medusa": "medusa", "mlp_speculator": "mlp_speculator"}


def detect_method(model: str, draft: TargetInfo) -> tuple[str, str]:
    """``(method, reason)`` for the draft checkpoint ``model`` whose config is ``draft``."""
    speculators_type = draft.hf_config.get("speculators_model_type")
    if isinstance(speculators_type, str) and speculators_type:
        return speculators_type, f"its config has speculators_model_type {speculators_type!r}"
    for architecture in draft.architectures:
        if architecture in _ARCHITECTURE_METHODS:
            return _ARCHITECTURE_METHODS[architecture], f"its architecture is {architecture}"
    if draft.model_type in _MODEL_TYPE_METHODS:
        return _MODEL_TYPE_METHODS[draft.model_type], f"its model_type is {draft.model_type!r}"
    if "medusa_num_heads" in draft.hf_config:  # FasterDecoding's config names no model_type
        return "medusa", "its config has medusa_num_heads"
    name = model.lower()
    for marker, method in (("eagle3", "eagle3"), ("eagle-", "eagle"), ("dflash", "dflash"), ("dspark", "dspark")):
        if marker in name:
            return method, f"its name contains {marker!r}"
    if "dflash_config" in draft.hf_config:
        return "dflash", "its config has dflash_config"
    return "draft_model", "a generic draft model"
