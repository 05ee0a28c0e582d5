"""Self-distillation data: the target answers the training prompts greedily through Sonar's engine,
and the ``extract_hidden_states`` method exports its hidden states per request.

One file per prompt (``<folder>/<prompt id>.safetensors``, the format of
:mod:`sonar_core.spec_decode.hidden_state_files`): the prompt and answer tokens, the residual-stream
states EAGLE-3 and DFlash read (``layer_ids``, EAGLE-3's default layers) and the final post-norm
state Medusa and the MLP speculator read, which also gives every position's target distribution
(the training labels). Nothing is computed twice: the states are the ones the target computes
while it answers.

The prompts are ``num_prompts`` of the four domains and ``conversation_prompts`` of the
conversation set (:mod:`sonar_core.training.prompts`), and ``generated_prompts`` the target writes
itself (:mod:`sonar_core.training.generated_prompts`, kept in the folder), each list from its own
generator, so any count can grow and the files of the other lists stay valid: data is added to a
folder, never redone.

Generation is resumable: each list's prompts run in fixed chunks, and a chunk counts as done only
when every one of its files exists, so an interrupted chunk is run again whole and the data is the
same as an uninterrupted run's. ``manifest.json`` records the settings (``auto`` dtype resolved to
the one the engine takes here); a folder made with other settings is refused rather than mixed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sonar_core.errors import ConfigError
from sonar_core.spec_decode.hidden_state_files import file_name
from sonar_core.training.generated_prompts import GeneratedPrompts, engine_sampler
from sonar_core.training.prompts import TrainingPrompt, build_conversation_prompts, build_prompts

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "sonar-self-distillation"
# Target-written prompts made beyond the training ones, for the held-out evaluation's share.
GENERATED_SPARE = 64


@dataclass(frozen=True)
class DataSpec:
    """What the data is made of; every field but the prompt counts must match to reuse a folder
    (more prompts extend it: the prompt lists of a seed are the same whatever their lengths)."""

    model: str | None
    num_prompts: int
    max_tokens: int
    seed: int
    dtype: str
    layer_ids: tuple[int, ...]  # vLLM capture ids (Sonar's index)
    max_num_seqs: int = 24
    # Prompts of the conversation set, beside the ``num_prompts`` of the four domains.
    conversation_prompts: int = 0
    # Prompts the target writes itself, beside both.
    generated_prompts: int = 0

    @property
    def chunk_size(self) -> int:
        """Prompts per resumable chunk: a few engine batches."""
        return 4 * self.max_num_seqs

    def comparable(self) -> dict[str, Any]:
        fields = asdict(self)
        fields.pop("num_prompts")
        fields.pop("conversation_prompts")
        fields.pop("generated_prompts")
        fields["layer_ids"] = list(self.layer_ids)
        fields["dtype"] = resolved_dtype(self.dtype)
        return fields


def resolved_dtype(dtype: str) -> str:
    """The dtype the engine answers in for ``dtype`` (``auto`` depends on the machine), which is
    what the data is made of and what a folder records."""
    from sonar_core.config.engine import EngineConfig

    return EngineConfig(dtype=dtype).resolved_dtype()


def prompt_lists(spec: DataSpec) -> list[list[TrainingPrompt]]:
    """The training prompts built from the seed, as their separately generated lists (four
    domains, conversation set); the target-written ones are the data folder's
    (:meth:`SelfDistillationData.prompt_lists`)."""
    lists = [build_prompts(spec.num_prompts, spec.seed)]
    if spec.conversation_prompts:
        lists.append(build_conversation_prompts(spec.conversation_prompts, spec.seed))
    return lists


def training_prompts(spec: DataSpec) -> list[TrainingPrompt]:
    return [prompt for prompts in prompt_lists(spec) for prompt in prompts]


def held_out_prompts(
    spec: DataSpec, count: int, generated_spare: Sequence[TrainingPrompt] = ()
) -> list[TrainingPrompt]:
    """``count`` prompts of the same domains that are not among the training prompts (another
    seed, with any text the training set holds left out); with conversation or target-written
    prompts in the data, a share of each as large as theirs in it, the target-written ones from
    ``generated_spare`` (those it wrote beyond the training ones, :meth:`SelfDistillationData.spare`)."""
    seen = {prompt.text for prompt in training_prompts(spec)}
    total = spec.num_prompts + spec.conversation_prompts + spec.generated_prompts

    def share(prompts: int) -> int:  # of ``count``, as ``prompts`` are of the training data
        return round(count * prompts / total) if total else 0

    conversation = share(spec.conversation_prompts)
    generated = min(share(spec.generated_prompts), len(generated_spare))
    seed = spec.seed + 1_000_003
    fresh = [p for p in build_prompts(2 * count + 8, seed) if p.text not in seen][: count - conversation - generated]
    if conversation:
        more = build_conversation_prompts(4 * conversation + 8, seed)
        fresh += [p for p in more if p.text not in seen][:conversation]
    return fresh + list(generated_spare[:generated])


class SelfDistillationData:
    """The folder of exported files for one :class:`DataSpec`."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def prompt_lists(self, spec: DataSpec) -> list[list[TrainingPrompt]]:
        """Every list of training prompts: those built from the seed, then the target-written ones
        this folder holds (a ConfigError when it holds fewer than ``spec`` asks for)."""
        lists = prompt_lists(spec)
        if spec.generated_prompts:
            lists.append(GeneratedPrompts(self.folder, spec.seed).first(spec.generated_prompts))
        return lists

    def spare(self, spec: DataSpec) -> list[TrainingPrompt]:
        """Target-written prompts this folder holds beyond the training ones (held out)."""
        written = GeneratedPrompts(self.folder, spec.seed).read() if spec.generated_prompts else []
        return written[spec.generated_prompts : spec.generated_prompts + GENERATED_SPARE]

    def files(self, spec: DataSpec) -> list[Path]:
        """The files of the training prompts, in prompt order (all must exist)."""
        paths = [self.folder / file_name(p.id) for part in self.prompt_lists(spec) for p in part]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise ConfigError(
                "work_dir",
                f"{self.folder} lacks {len(missing)} of its {len(paths)} data files (first: {missing[0]})",
                "run the data step again with the same settings; it completes the folder",
            )
        return paths

    def check_manifest(self, spec: DataSpec) -> None:
        """Refuse a folder made with other settings (it would mix two datasets)."""
        manifest = self.folder / MANIFEST
        if not manifest.is_file():
            return
        recorded = json.loads(manifest.read_text())
        differing = sorted(k for k, v in spec.comparable().items() if recorded.get(k) != v)
        if differing:
            changes = ", ".join(f"{k}: {recorded.get(k)!r} -> {spec.comparable()[k]!r}" for k in differing)
            raise ConfigError(
                "work_dir",
                f"{self.folder} holds data made with other settings ({changes})",
                "use another --work-dir for these settings, or the settings the folder was made with"
                + (" (the folder recorded dtype 'auto', from before it was resolved: write the dtype it was made"
                   " with into its manifest.json)" if recorded.get("dtype") == "auto" else ""),
            )

    def generate(
        self,
        spec: DataSpec,
        progress: Callable[[int, int, int], None] | None = None,
        prompt_progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Make every missing file of ``spec``; returns the number of prompts generated now.

        ``progress(done, total, new_tokens)`` is called after every finished request, and
        ``prompt_progress(written, total)`` while the target writes its own prompts.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        self.check_manifest(spec)
        manifest = {"format": FORMAT, "version": 1, **spec.comparable(), "num_prompts": spec.num_prompts,
                    "conversation_prompts": spec.conversation_prompts, "generated_prompts": spec.generated_prompts}
        (self.folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        self._write_generated_prompts(spec, prompt_progress)
        lists = self.prompt_lists(spec)
        prompts = [prompt for part in lists for prompt in part]
        # Chunked list by list, so that growing one list never reopens a chunk of another.
        chunks = [part[i : i + spec.chunk_size] for part in lists for i in range(0, len(part), spec.chunk_size)]
        todo = [chunk for chunk in chunks if not all((self.folder / file_name(p.id)).is_file() for p in chunk)]
        done = len(prompts) - sum(len(chunk) for chunk in todo)
        if progress is not None:
            progress(done, len(prompts), 0)
        if not todo:
            return 0
        llm = self._engine(spec)
        generated = 0
        for chunk in todo:
            for prompt in chunk:  # an interrupted chunk is redone whole
                (self.folder / file_name(prompt.id)).unlink(missing_ok=True)
            for tokens in self._run_chunk(llm, chunk, spec):
                done += 1
                generated += 1
                if progress is not None:
                    progress(done, len(prompts), tokens)
        return generated

    def _write_generated_prompts(self, spec: DataSpec, progress: Callable[[int, int], None] | None) -> None:
        """Have the target write the prompts ``spec`` asks for that the folder lacks, and the
        held-out spare, with an engine of its own (the answers' engine exports states)."""
        if not spec.generated_prompts:
            return
        prompts = GeneratedPrompts(self.folder, spec.seed)
        wanted = spec.generated_prompts + GENERATED_SPARE
        if len(prompts.read()) >= wanted:
            return
        from sonar_core.entrypoints.llm import LLM

        llm = LLM(model=spec.model, dtype=resolved_dtype(spec.dtype), seed=spec.seed, max_num_seqs=spec.max_num_seqs)
        added = prompts.extend(wanted, engine_sampler(llm), progress)
        logger.info("the target wrote %d prompts (%s)", added, prompts.path)

    def _engine(self, spec: DataSpec) -> Any:
        from sonar_core.entrypoints.llm import LLM

        speculative = {
            "method": "extract_hidden_states",
            "output_dir": str(self.folder),
            "layer_ids": list(spec.layer_ids),
            "include_final": True,
        }
        return LLM(model=spec.model, dtype=resolved_dtype(spec.dtype), seed=spec.seed, max_num_seqs=spec.max_num_seqs,
                   speculative_config=speculative)

    def _run_chunk(self, llm: Any, chunk: list[TrainingPrompt], spec: DataSpec):
        """Generate one chunk greedily; yields each finished request's number of new tokens."""
        from sonar_core.sampling_params import SamplingParams

        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens)
        for prompt in chunk:
            text = engine.tokenizer.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
            engine.add_request(text, params, request_id=prompt.id)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                if output.error:
                    raise RuntimeError(f"prompt {output.request_id}: {output.error}")
                yield len(output.outputs[0].token_ids)
        logger.debug("chunk of %d prompts in %.1f s", len(chunk), time.perf_counter() - start)

