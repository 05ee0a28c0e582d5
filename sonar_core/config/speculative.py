"""The speculative-decoding configuration: one model for the command line, Python and JSON.

``aphrodite serve --speculative-config '{...}'``, ``LLM(speculative_config={...})`` and a JSON file
all end up here. The core fields are the ones the user documentation names; any other key is kept
(``extra="allow"``) and handed to the options model of the plugin that owns the method, which
rejects the keys it does not know (see ``sonar_core.config.validation``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from sonar_core.config.json_value import parse_json_object
from sonar_core.config.validation_errors import config_error_from_validation
from sonar_core.errors import ConfigError

FIELD = "speculative_config"

DraftSampleMethod = Literal["greedy", "probabilistic"]
DepthPolicy = Literal["fixed", "auto"]


class SpeculativeConfig(BaseModel):
    """How the engine speculates: the method, its checkpoint and its limits.

    Rules that need only these fields are checked on construction; rules that need the target or
    the installed plugins are checked by ``validate_speculative_config``.
    """

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    method: str | None = None
    """The speculation method (``aphrodite plugins`` lists the installed ones). Old names such as
    ``deepseek_mtp`` are mapped to their method with a warning. When unset and ``model`` is given,
    ``draft_model`` is used."""

    model: str | None = None
    """The draft checkpoint, EAGLE head, assistant or extra weights: a local folder with
    config.json, a .gguf file or a Hugging Face repository id. Unset: the method uses the target
    checkpoint (MTP layers inside the target) or needs no checkpoint (n-gram, suffix)."""

    revision: str | None = None
    """Branch, tag or commit of ``model`` when it is a repository id. Unset: the default branch
    (not the target's revision)."""

    num_speculative_tokens: int | None = None
    """The maximum number of draft tokens per step. Every method needs it; some also impose a limit
    from the draft checkpoint, and suffix decoding may draft fewer."""

    prompt_lookup_min: int | None = None
    """N-gram methods: the shortest suffix of the sequence looked up in the prompt. Unset: the
    method's default."""

    prompt_lookup_max: int | None = None
    """N-gram methods: the longest suffix looked up in the prompt. Unset: the method's default."""

    draft_tensor_parallel_size: int | None = None
    """Devices the draft model is split over: 1 or the target's tensor_parallel_size. Unset: 1."""

    use_heterogeneous_vocab: bool = False
    """Let a generic draft model with a different vocabulary draft through the tokens both
    vocabularies share. Needs greedy draft sampling."""

    draft_sample_method: DraftSampleMethod = "greedy"
    """``greedy`` drafts the most likely token; ``probabilistic`` samples from the draft
    distribution and keeps the draft probabilities for rejection sampling (more memory)."""

    attention_backend: str | None = None
    """Attention backend of the draft (``TORCH_SDPA`` or ``FLASH_ATTN``), for drafts that need
    non-causal attention. Unset: ``TORCH_SDPA``. ``FLASH_ATTN`` runs as ``TORCH_SDPA`` on the CPU."""

    max_model_len: int | None = None
    """The longest sequence the draft handles; speculation stops for longer requests. It cannot
    exceed the limit of the target or of the draft checkpoint. Unset: the draft checkpoint's own
    limit for methods bounded by it (draft_model, dflash, dspark), else the target's."""

    parallel_drafting: bool | None = None
    """Draft a whole block in one pass. Unset: the method decides (DFlash and DSpark always
    draft in parallel and reject an explicit value)."""

    depth_policy: DepthPolicy = "fixed"
    """``fixed`` drafts up to num_speculative_tokens every step; ``auto`` chooses each request's
    depth (at most num_speculative_tokens) from its measured acceptance and the measured step cost,
    and stops drafting when drafting would cost throughput (large batches)."""

    num_draft_branches: int | None = None
    """Chains a request drafts per step, for methods whose proposer drafts branches (those that list
    this field; others warn that it has no effect). Above 1, the head's next best first tokens each
    start a chain of their own, verified beside the request's chain in the same target pass; the
    chain whose first token the target emits is kept. Each branch costs num_speculative_tokens
    more target rows. Unset: 3 for a request that drafts alone in its step where a few more
    verified rows cost little on the CPU (bfloat16 on AMX tiles), 1 otherwise
    (``sonar_core.engine.speculator.DraftBranching``)."""

    draft_stop_confidence: float | None = None
    """For methods that draft token by token from a head (those that list this field): a request
    stops drafting for the step once the head gives its chain (with draft branches, each of its
    chains) less than this probability, the product of the head's top probabilities along it. Each
    draft costs a draft pass and a verified row; one the head gives little chance is seldom
    accepted. 0 drafts num_speculative_tokens every step. Unset: for a request drafting its chain
    alone on the CPU, 0.3 where a few more verified rows cost little (bfloat16 on AMX tiles) and
    0.5 where each costs its multiply-adds, 0 on accelerators; 0.1 for one with draft branches
    (``sonar_core.spec_decode.chain_proposer.ChainStops``)."""

    @field_validator("method", "model")
    @classmethod
    def _not_blank(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not value.strip():
            raise ConfigError(
                f"{FIELD}.{info.field_name}",
                "the value is an empty string",
                f"remove {info.field_name!r} or give it a value",
            )
        return value.strip() if value is not None else None

    @field_validator("num_speculative_tokens")
    @classmethod
    def _positive_depth(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ConfigError(
                f"{FIELD}.num_speculative_tokens",
                f"the number of draft tokens per step must be positive, got {value}",
                "set num_speculative_tokens to 1 or more; start with 1 to 3 and raise it while later "
                "positions are still accepted",
            )
        return value

    @field_validator("num_draft_branches")
    @classmethod
    def _positive_branches(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ConfigError(
                f"{FIELD}.num_draft_branches",
                f"the number of draft chains per request must be positive, got {value}",
                "set num_draft_branches to 1 (one chain) or 2 to 3 (chains from the draft's best first tokens)",
            )
        return value

    @field_validator("draft_stop_confidence")
    @classmethod
    def _probability(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ConfigError(
                f"{FIELD}.draft_stop_confidence",
                f"must be a probability between 0 and 1, got {value}",
                "set draft_stop_confidence to 0 (always draft num_speculative_tokens) up to 1, or remove it "
                "for the defaults (0 to 0.5, by the device and draft branches)",
            )
        return value

    @field_validator("draft_tensor_parallel_size")
    @classmethod
    def _positive_draft_tp(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ConfigError(
                f"{FIELD}.draft_tensor_parallel_size",
                f"must be 1 or the target's tensor_parallel_size, got {value}",
                "set draft_tensor_parallel_size to 1, or remove it",
            )
        return value

    @field_validator("max_model_len")
    @classmethod
    def _positive_max_len(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ConfigError(
                f"{FIELD}.max_model_len",
                f"the draft's maximum sequence length must be positive, got {value}",
                "set max_model_len to a positive number of tokens, or remove it to use the target's limit",
            )
        return value

    @field_validator("attention_backend")
    @classmethod
    def _backend_name(cls, value: str | None) -> str | None:
        return value.strip().upper() if value is not None else None

    @model_validator(mode="after")
    def _heterogeneous_vocab_needs_greedy(self) -> SpeculativeConfig:
        if self.use_heterogeneous_vocab and self.draft_sample_method != "greedy":
            raise ConfigError(
                f"{FIELD}.use_heterogeneous_vocab",
                "use_heterogeneous_vocab needs greedy draft sampling, but draft_sample_method is "
                f"{self.draft_sample_method!r}",
                'remove draft_sample_method (greedy is the default), or set "use_heterogeneous_vocab": false',
            )
        return self

    @property
    def method_options(self) -> dict[str, Any]:
        """The keys beyond the core fields: the method's own options, for its options model."""
        return dict(self.model_extra or {})

    @classmethod
    def build(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """A configuration from an instance, a mapping or JSON text; any problem is a ConfigError."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = parse_json_object(value, FIELD)
        if not isinstance(value, Mapping):
            raise ConfigError(
                FIELD,
                f"expected a JSON object or a dict, got {type(value).__name__}",
                'pass a dict such as {"method": "ngram", "num_speculative_tokens": 4}',
            )
        try:
            return cls.model_validate(dict(value))
        except ValidationError as exc:
            raise config_error_from_validation(exc, FIELD, cls.model_fields) from None


CORE_FIELDS: tuple[str, ...] = tuple(SpeculativeConfig.model_fields)
# Core fields only some methods read; each method declares the ones it reads (MethodSpec.core_fields),
# and setting another is warned about (it has no effect). Every other core field applies to all.
METHOD_SPECIFIC_FIELDS: tuple[str, ...] = (
    "prompt_lookup_min",
    "prompt_lookup_max",
    "use_heterogeneous_vocab",
    "attention_backend",
    "parallel_drafting",
    "draft_tensor_parallel_size",
    "num_draft_branches",
    "draft_stop_confidence",
)
