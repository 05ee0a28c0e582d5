from sonar_core.engine.block_manager import BlockManager
from sonar_core.engine.detokenizer import IncrementalDetokenizer
from sonar_core.engine.scheduler import Scheduler
from sonar_core.engine.sequence import Sequence, SequenceStatus
from sonar_core.outputs import RequestMetrics
from sonar_core.sampling_params import SamplingParams


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _seq(request_id: str, prompt_len: int) -> Sequence:
    prompt = list(range(prompt_len))
    return Sequence(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt,
        params=SamplingParams(),
        metrics=RequestMetrics(arrival_time=0.0),
        detokenizer=IncrementalDetokenizer(_CharTokenizer(), prompt),
        generator=None,
        eos_token_ids=frozenset(),
    )


def _run(sched_out):
    """Pretend the model ran: advance computed tokens and emit one token where the step samples."""
    for item in sched_out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.samples:
            item.seq.output_token_ids.append(1)


def test_chunked_prefill_under_token_budget():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    long, short = _seq("long", 25), _seq("short", 3)
    scheduler.add(long)
    scheduler.add(short)
    out = scheduler.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("long", 10)]
    assert not out.scheduled[0].samples
    _run(out)
    out = scheduler.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("long", 10)]
    _run(out)
    out = scheduler.schedule()
    # The rest of the long prompt, then the short prompt joins in the same step.
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("long", 5), ("short", 3)]
    assert all(i.samples for i in out.scheduled)


def test_max_num_seqs_limits_running_requests():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        scheduler.add(_seq(str(i), 2))
    out = scheduler.schedule()
    assert len(out.scheduled) == 2
    assert len(scheduler.waiting) == 1


def test_drafts_follow_the_known_tokens_and_fit_the_budget():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=4)
    seq = _seq("a", 2)
    scheduler.add(seq)
    _run(scheduler.schedule())
    seq.draft_token_ids = [5, 6, 7, 8, 9]
    out = scheduler.schedule()
    item = out.scheduled[0]
    assert item.num_new_tokens == 1
    assert item.draft_token_ids == [5, 6, 7]  # budget 4 = 1 known token + 3 drafts
    assert item.num_query_tokens == 4


def test_preemption_frees_blocks_and_requeues_first():
    manager = BlockManager(num_blocks=4, block_size=2)
    preempted: list[str] = []
    scheduler = Scheduler(manager, 4, 100, on_preempt=lambda s: preempted.append(s.request_id))
    a, b = _seq("a", 3), _seq("b", 3)
    scheduler.add(a)
    scheduler.add(b)
    _run(scheduler.schedule())  # each holds 2 blocks (3 tokens), cache full
    _run(scheduler.schedule())  # the 4th token of each still fits
    assert manager.num_free_blocks == 0
    out = scheduler.schedule()  # a needs a third block for its 5th token: b is preempted
    assert preempted == ["b"]
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert scheduler.waiting[0] is b
    scheduler.finish(a)
    assert manager.num_free_blocks == 4
    out = scheduler.schedule()
    # b is recomputed from scratch: prompt plus its output so far.
    assert out.scheduled[0].seq is b and out.scheduled[0].num_new_tokens == 5
