"""Per-request sampling parameters, with the OpenAI/vLLM field names users already know."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy decoding; top_k/top_p/min_p then have no effect. A ``seed``
    gives the request its own random generator, so its samples do not depend on batch neighbours.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    temperature: float = Field(1.0, ge=0.0, description="0 selects greedy decoding.")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 disables.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    seed: int | None = Field(None, description="Per-request seed for reproducible sampling.")
    max_tokens: int | None = Field(16, ge=1, description="Maximum number of generated tokens.")
    min_tokens: int = Field(0, ge=0, description="Tokens to generate before EOS/stop may end.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (not included).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    logprobs: int | None = Field(None, ge=0, description="Return the logprob of sampled tokens.")
    include_stop_str_in_output: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @model_validator(mode="after")
    def _normalise_top_k(self) -> SamplingParams:
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
