"""The engine: requests in, one step at a time, outputs out."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sonar_core import cpu_kernels
from sonar_core.attention_backends import AttentionBackend, get_backend
from sonar_core.config import EngineConfig, ResolvedSpeculativeConfig, SpeculativeConfig, validate_config
from sonar_core.engine.block_manager import BlockManager, resolve_prefix_caching
from sonar_core.engine.cpu_threads import ThreadGovernor
from sonar_core.engine.detokenizer import IncrementalDetokenizer
from sonar_core.engine.kv_budget import WorkingMemory, plan_kv_blocks
from sonar_core.engine.model_runner import ModelRunner, ModelRunOutput
from sonar_core.engine.request_checks import check_request
from sonar_core.engine.request_errors import RequestError
from sonar_core.engine.scheduler import Scheduler, SchedulerOutput
from sonar_core.engine.sequence import Sequence
from sonar_core.engine.speculator import DraftBranching, ProposeItem, Speculator
from sonar_core.engine.speculator_factory import build_speculator
from sonar_core.engine.stop_checker import apply_stop_conditions
from sonar_core.engine.tensor_parallel import (
    DRAFT,
    TARGET,
    MirroredStateCache,
    SplitDraftLoader,
    start_tensor_parallel,
)
from sonar_core.engine.verifier import Verifier
from sonar_core.errors import ConfigError
from sonar_core.hub import FileSet
from sonar_core.kv import RecurrentStateCache, StateLayerSpec, allocate_kv_cache
from sonar_core.layers.linear import extra_rows_cost_little, skinny_linear_path
from sonar_core.model_files import DEFAULT_MODEL_NAME, resolve_model_path
from sonar_core.models.hidden_capture import HiddenStateCapture
from sonar_core.models.loader import LoadedModel, load_model, load_tokenizer
from sonar_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sonar_core.plugins.manager import SonarPluginManager, get_plugin_manager
from sonar_core.sample.sampler import make_generator
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.metrics import SpecDecodingStats
from sonar_core.spec_decode.proposer import ProposerCapabilities, ProposerContext

logger = logging.getLogger("sonar.engine")


@dataclass
class StepTiming:
    """Wall-clock seconds the engine spent in the target's forward (with verification) and in the
    proposer, over every step so far: ``propose_s / target_s`` is the draft's cost as a fraction of
    the target's. Both end in a read-back of tokens, so the times hold on CUDA too."""

    target_s: float = 0.0
    propose_s: float = 0.0
    steps: int = 0


class LLMEngine:
    """Continuous-batching engine with optional speculative decoding.

    One :meth:`step` is: schedule -> run the target over every request's new tokens and drafts ->
    sample or verify -> update requests (stop conditions, detokenization) -> propose next drafts.
    """

    def __init__(self, config: EngineConfig, plugin_manager: SonarPluginManager | None = None) -> None:
        # Every configuration rule runs before any weight loads.
        plugin_manager = plugin_manager or get_plugin_manager()
        validated = validate_config(config, plugin_manager)
        config = validated.engine
        _require_one_replica(config)
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        torch.manual_seed(config.seed)
        speculative = validated.speculative
        claimed = plugin_manager.target_tensor_claims(speculative.config if speculative else None, validated.target)
        self.workers = start_tensor_parallel(config.tensor_parallel_size, self.device)
        target_args = dict(model=config.model, dtype=self.dtype, device=self.device, claimed_prefixes=claimed,
                           revision=config.revision, trust_remote_code=config.trust_remote_code)
        loaded = self.workers.load_model(TARGET, **target_args) if self.workers else load_model(**target_args)
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.tokenizer = load_tokenizer(self._tokenizer_source(config, loaded),
                                        trust_remote_code=config.trust_remote_code)
        self.model_name = config.model or DEFAULT_MODEL_NAME
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = config.max_model_len
        token_budget = config.token_budget(self.max_model_len)
        self.spec_stats = SpecDecodingStats(
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0
        )
        plan = None
        if speculative is not None:
            context = ProposerContext(
                speculative_config=speculative.config,
                method_options=speculative.options,
                target_model=self.model,
                target_hf_config=self.hf_config,
                target_tokenizer=self.tokenizer,
                dtype=self.dtype,
                device=self.device,
                max_model_len=self.max_model_len,
                target_modules=self.model.shared_modules(),
                target_model_dir=loaded.model_dir,
                max_num_batched_tokens=token_budget,
                max_num_seqs=config.max_num_seqs,
                split_draft=SplitDraftLoader(self.workers) if speculative.config.draft_tensor_parallel_size > 1 else None,
            )
            plan = build_speculator(speculative, context, plugin_manager)
            self._say_where_the_draft_runs(speculative.config)
            self._say_when_branches_cost(speculative.config)
        target_specs = self.model.kv_cache_specs()
        proposer_specs = list(plan.capabilities.kv_layers) if plan else []
        state_specs = self.model.state_specs()
        branching = DraftBranching()
        if plan is not None:
            branching = self._draft_branching(speculative, plan.capabilities, bool(state_specs))
        # Before any KV is allocated: an explicit true that would not be lossless is a ConfigError.
        self.prefix_caching = resolve_prefix_caching(
            config.enable_prefix_caching, plan.capabilities if plan else None, bool(state_specs)
        )
        # A verification step keeps the state after each of its last len(drafts) + 1 tokens.
        state_positions = plan.num_speculative_tokens + 1 if plan and state_specs else 0
        working = WorkingMemory.of(
            config,
            self.model.shared_modules().vocab_size,
            plan.num_speculative_tokens if plan else 0,
            draft_probs=bool(plan and plan.capabilities.returns_draft_probs),
            recurrent_state_bytes=RecurrentStateCache.memory_bytes(
                state_specs, config.max_num_seqs, state_positions, self.dtype
            ),
        )
        num_blocks = plan_kv_blocks(config, target_specs + proposer_specs, self.dtype, self.max_model_len, working)
        caches = allocate_kv_cache(target_specs + proposer_specs, num_blocks, config.block_size, self.dtype,
                                   self.device)
        if self.workers is not None:
            self.workers.allocate_kv(TARGET, target_specs, num_blocks, config.block_size, self.dtype)
            if DRAFT in self.workers.keys:  # a draft split like the target: its KV is split too
                self.workers.allocate_kv(DRAFT, proposer_specs, num_blocks, config.block_size, self.dtype)
        lookahead = (plan.capabilities.prefix_cache_lookahead or 0) if plan else 0
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_caching=self.prefix_caching, lookahead=lookahead
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, token_budget, on_preempt=self._on_preempt
        )
        capabilities = plan.capabilities if plan else ProposerCapabilities()
        self.state_cache = self._state_cache(state_specs, config.max_num_seqs, state_positions)
        self.runner = ModelRunner(
            self.model,
            caches[: len(target_specs)],
            config.block_size,
            self.device,
            capture=self._hidden_capture(capabilities, token_budget),
            keep_final_hidden=capabilities.target_final_hidden,
            state_cache=self.state_cache,
        )
        self.speculator: Speculator | None = None
        if plan is not None:
            self.speculator = Speculator(
                plan.proposer,
                plan.num_speculative_tokens,
                plan.draft_max_model_len,
                self.block_manager,
                caches[len(target_specs) :],
                self.device,
                adaptive_depth=plan.adaptive_depth,
                attention_backend=self._attention_backend(speculative.config.attention_backend),
                target_kv_caches=caches[: len(target_specs)],
                branching=branching,
            )
        self.verifier = Verifier(self.device)
        # Split over ranks, every rank keeps its fixed share of the cores (start_tensor_parallel).
        self.thread_governor = (
            ThreadGovernor.for_this_machine() if self.device.type == "cpu" and self.workers is None else None
        )
        self.timing = StepTiming()
        self._requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._ids = itertools.count()
        logger.info(
            "engine ready: model=%s dtype=%s device=%s max_model_len=%d kv_blocks=%d x %d tokens "
            "prefix_caching=%s%s%s",
            self.model_name, self.dtype, self.device, self.max_model_len, num_blocks, config.block_size,
            "on" if self.prefix_caching else "off",
            f" cpu_kernels={'on' if cpu_kernels.load() is not None else 'off'}" if self.device.type == "cpu" else "",
            f" speculative={config.speculative_config.method}" if plan else "",
        )

    def _state_cache(self, specs: list[StateLayerSpec], num_slots: int, positions: int) -> RecurrentStateCache | None:
        """The target's recurrent states (linear-attention layers), kept on every rank when split."""
        if not specs:
            return None
        if self.workers is not None:
            return MirroredStateCache(self.workers, TARGET, specs, num_slots, positions, self.dtype, self.device)
        return RecurrentStateCache(specs, num_slots, positions, self.dtype, self.device)

    def _draft_branching(
        self, speculative: ResolvedSpeculativeConfig, capabilities: ProposerCapabilities, has_recurrent_state: bool
    ) -> DraftBranching:
        """The draft branches asked for, or where unset those that pay here (DraftBranching.of).
        Branches need a KV fork per chain: a recurrent state is one per request."""
        configured = speculative.config.num_draft_branches
        if configured is not None and configured > 1 and has_recurrent_state:
            raise ConfigError(
                "speculative_config.num_draft_branches",
                "draft branches are not supported when the target keeps recurrent states (linear attention)",
                "remove num_draft_branches (one chain per request)",
            )
        branching = DraftBranching.of(
            configured,
            "num_draft_branches" in speculative.spec.core_fields and capabilities.max_draft_branches > 1,
            self.device,
            self.dtype,
            forkable=not has_recurrent_state and self.workers is None,
        )
        if configured is None and branching.count > 1:
            logger.info(
                "draft branches: a request drafting alone in its step also drafts chains from the head's "
                "next %d best first tokens (%s on AMX tiles; speculative_config.num_draft_branches: 1 for "
                "one chain)", branching.count - 1, str(self.dtype).removeprefix("torch."),
            )
        return branching

    def _say_when_branches_cost(self, speculative: SpeculativeConfig) -> None:
        """Draft branches pay where extra verified rows cost next to nothing: on the CPU, in
        bfloat16 on AMX tiles. Elsewhere they measured slower than a chain (docs/performance.md)."""
        branches = speculative.num_draft_branches
        if branches is None or branches == 1 or extra_rows_cost_little(self.device, self.dtype):
            return
        path = skinny_linear_path(self.dtype) or "PyTorch's"
        logger.warning(
            "speculative_config.num_draft_branches=%d: this CPU verifies %s rows with %s matmuls, not AMX "
            "tiles, and every branch adds num_speculative_tokens + 1 rows; branches measured slower than a "
            "single chain there (docs/performance.md). Remove num_draft_branches unless a benchmark here "
            "says otherwise",
            speculative.num_draft_branches, str(self.dtype).removeprefix("torch."), path,
        )

    def _say_where_the_draft_runs(self, speculative: SpeculativeConfig) -> None:
        """A draft asked to split over the target's ranks that the method keeps whole on the driver."""
        if self.workers is None or speculative.draft_tensor_parallel_size == 1 or DRAFT in self.workers.keys:
            return
        logger.warning(
            "speculative_config.draft_tensor_parallel_size=%d: method %s runs its draft layers whole on the "
            "driver rank (they read the full hidden states there); only a separate draft model is split",
            speculative.draft_tensor_parallel_size, speculative.method,
        )

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (a tensor-parallel rank died), or None: the server's
        ``/health`` answers 503 with it, and every later step fails with the same reason."""
        return self.workers.dead if self.workers is not None else None

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do on one device). Idempotent;
        also runs at interpreter exit."""
        if self.workers is not None:
            self.workers.close()

    @staticmethod
    def _tokenizer_source(config: EngineConfig, loaded: LoadedModel) -> LoadedModel | Path:
        """The model's own tokenizer, or the folder of the one ``tokenizer`` names (at
        ``tokenizer_revision``), with its repository's code files under trust_remote_code."""
        if config.tokenizer is None:
            return loaded
        files = FileSet(tokenizer=True, code=config.trust_remote_code)
        return resolve_model_path(config.tokenizer, config.tokenizer_revision, files)

    def _attention_backend(self, name: str | None) -> AttentionBackend:
        """The draft's attention backend; says so when the device runs another one instead."""
        backend = get_backend(name)
        running = backend.runs_as(self.device)
        if running != backend.name:
            logger.warning(
                "speculative_config.attention_backend %s has no kernel on %s; the draft runs %s instead",
                backend.name, self.device.type, running,
            )
        return backend

    def _hidden_capture(self, capabilities: ProposerCapabilities, max_tokens: int) -> HiddenStateCapture | None:
        """The persistent buffer the target writes the proposer's requested states into."""
        if not capabilities.target_hidden_layers:
            return None
        modules = self.model.shared_modules()
        return HiddenStateCapture(
            capabilities.target_hidden_layers, modules.num_layers, modules.hidden_size, max_tokens, self.dtype,
            self.device,
        )

    # ----------------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; raise :class:`RequestError` when it cannot be served as given."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        seed = params.seed
        seq = Sequence(
            request_id=request_id,
            prompt=prompt_text,
            prompt_token_ids=token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time or time.monotonic()),
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids),
            generator=make_generator(seed, self.device) if seed is not None else None,
            eos_token_ids=self.eos_token_ids,
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold run from 0 to ``vocab_size - 1``."""
        return self.hf_config.get_text_config(decoder=True).vocab_size

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free everything it holds; unknown ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        seq.finish_reason = "abort"
        self._release(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of requests that emitted text or finished.

        Requests that finish this step are released only after the proposer has seen the step,
        so that it receives their last target states (an exporter writes them out).
        """
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        if self.thread_governor is not None:
            self.thread_governor.observe()
        now = time.monotonic()
        for item in sched.scheduled:
            if item.seq.metrics.first_scheduled_time is None:
                item.seq.metrics.first_scheduled_time = now
        run = self.runner.execute(sched)
        result = self.verifier(run, sched.scheduled)
        self.runner.commit_states(sched, result.num_accepted)
        verified = time.monotonic()
        if self.speculator is not None:
            self.speculator.settle_branches(sched.scheduled, result.winners, result.num_accepted)
        updates = self._update(sched, result.token_ids, result.num_accepted, result.logprobs)
        self.scheduler.cache_full_blocks(sched)
        proposing = time.monotonic()
        num_drafted = self._propose(sched, run, result.num_accepted, result.winners)
        proposed = time.monotonic()
        self.timing.target_s += verified - now
        self.timing.propose_s += proposed - proposing
        self.timing.steps += 1
        if self.speculator is not None:
            self.speculator.observe_step(sched.num_tokens, num_drafted, proposed - now, proposed - proposing)
        finished_at = time.monotonic()
        for seq, _, _ in updates:
            if seq.finish_reason is not None:
                self._requests.pop(seq.request_id, None)
                self._release(seq)
                seq.metrics.finished_time = finished_at
        return [self._output(seq, kept, delta) for seq, kept, delta in updates]

    def _update(
        self,
        sched: SchedulerOutput,
        emitted: list[list[int]],
        num_accepted: list[int],
        logprobs: list[list[float] | None],
    ) -> list[tuple[Sequence, list[int], str]]:
        """Apply the step's tokens; per request that sampled: (request, tokens kept, text delta)."""
        now = time.monotonic()
        updates: list[tuple[Sequence, list[int], str]] = []
        for item, tokens, accepted, token_logprobs in zip(
            sched.scheduled, emitted, num_accepted, logprobs, strict=True
        ):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if not item.samples:
                continue
            if item.draft_token_ids:
                self.spec_stats.observe_draft(len(item.draft_token_ids), accepted)
                self.speculator.observe_verification(seq, len(item.draft_token_ids), accepted)
                seq.num_computed_tokens += accepted
            seq.clear_drafts()
            before_text = len(seq.detokenizer.text)
            kept = apply_stop_conditions(seq, tokens)
            seq.num_unproposed_tokens += len(kept)
            if token_logprobs is not None:
                seq.output_logprobs.extend(token_logprobs[: len(kept)])
            self._record_timing(seq, len(kept), now)
            updates.append((seq, kept, seq.detokenizer.text[before_text:]))
        return updates

    @staticmethod
    def _record_timing(seq: Sequence, num_tokens: int, now: float) -> None:
        if num_tokens == 0:
            return
        metrics = seq.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            num_tokens -= 1
        elif metrics.last_token_time is not None:
            gap = (now - metrics.last_token_time) / num_tokens
            metrics.inter_token_latencies.extend([gap] * num_tokens)
        metrics.last_token_time = now

    def _propose(
        self, sched: SchedulerOutput, run: ModelRunOutput, num_accepted: list[int], winners: list[int]
    ) -> int:
        """Ask the proposer for the next step's drafts; return how many tokens it drafted.

        Every request the target ran is handed over, prefill chunks included, with its valid rows
        of the step (the chunk, or the last accepted token and the accepted drafts, in the rows of
        the draft branch that won verification where one did).
        """
        if self.speculator is None:
            return 0
        items: list[ProposeItem] = []
        for index, (item, accepted, rows, start) in enumerate(
            zip(sched.scheduled, num_accepted, run.query_rows, run.start_positions, strict=True)
        ):
            if winners[index]:
                rows = run.branch_query_rows[index][winners[index] - 1]
            seq = item.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            finished = seq.finish_reason is not None
            # A stop inside the accepted drafts ends the request before them: its rows end there too.
            valid = min(item.num_new_tokens + accepted, seq.num_tokens - 1 - start)
            budget = self.speculator.draft_budget(seq, self.max_model_len) if item.samples and not finished else 0
            items.append(
                ProposeItem(
                    seq=seq,
                    budget=budget,
                    hidden_rows=slice(rows.start, rows.start + valid),
                    hidden_start=start,
                    partial_prefill=not item.samples,
                    finished=finished,
                )
            )
        if not items:
            return 0
        self.speculator.propose(items, run.hidden)
        return sum(len(item.seq.draft_token_ids) for item in items)

    def _output(self, seq: Sequence, delta_ids: list[int], delta_text: str) -> RequestOutput:
        """The request's output after this step, at a cost that does not grow with its length.

        A running request's token ids and logprobs are snapshot views of its lists (they only
        grow, so a view never changes); the finished request's are copied once, into plain lists.
        """
        finished = seq.finish_reason is not None
        wants_logprobs = seq.params.logprobs is not None
        if finished:
            token_ids = seq.output_token_ids.copy()
            logprobs = list(seq.output_logprobs) if wants_logprobs else None
        else:
            token_ids = seq.output_token_ids.snapshot()
            logprobs = seq.output_logprobs_snapshot() if wants_logprobs else None
        completion = CompletionOutput(
            index=0,
            text=seq.detokenizer.text,
            token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=seq.metrics,
            delta_text=delta_text,
            delta_token_ids=list(delta_ids),
            error=seq.error,
        )

    # -------------------------------------------------------------------------------- lifecycle
    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.state_cache is not None:
            self.state_cache.release(seq.request_id)
        if self.speculator is not None:
            seq.error = self.speculator.release(seq)
            if seq.error is not None:
                logger.error("request %s failed: %s", seq.request_id, seq.error)

    def _on_preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        if self.state_cache is not None:  # recomputed from position 0, so from a zero state
            self.state_cache.release(seq.request_id)
        if self.speculator is not None:
            self.speculator.release(seq)

    # -------------------------------------------------------------------------------- inspection
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens of the requests admitted so far (a preempted one counts again when it returns)."""
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of :attr:`prefix_cache_queries`, the tokens whose KV came from the prefix cache."""
        return self.scheduler.prefix_cache_hits


def _require_one_replica(config: EngineConfig) -> None:
    """An engine is one replica; several are the server's (each in a process of its own, which a
    script's ``LLM(...)`` cannot start safely: spawned processes re-run the script)."""
    if config.data_parallel_size != 1:
        raise ConfigError(
            "data_parallel_size",
            f"one engine runs one replica; data_parallel_size={config.data_parallel_size} is served by "
            "`aphrodite serve`",
            "serve the model with `aphrodite serve MODEL --data-parallel-size N`, or remove data_parallel_size "
            "here (1 is the default)",
        )
