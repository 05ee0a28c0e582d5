"""What a proposer hears about a request's life from the engine: start, drafts, the complete output
of a request that ended, and a discard for one that was aborted."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from aphrodite import LLM, SamplingParams

RECORDER = """
    from sonar_core.spec_decode.proposer import DraftProposal, Proposer

    CALLS = []

    class Recorder(Proposer):
        def __init__(self, context):
            pass

        def propose(self, batch):
            return DraftProposal(token_ids=[[] for _ in batch.requests])

        def add_request(self, request_id, prompt_token_ids):
            CALLS.append(("add", request_id, list(prompt_token_ids)))

        def finish_request(self, request_id, token_ids):
            CALLS.append(("finish", request_id, list(token_ids)))

        def remove_request(self, request_id):
            CALLS.append(("remove", request_id))

        def discard_request(self, request_id):
            CALLS.append(("discard", request_id))
"""


def test_a_finished_request_hands_over_every_token_and_an_aborted_one_is_discarded(target_dir: Path, tmp_path: Path) -> None:
    module = tmp_path / "lifecycle_recorder.py"
    module.write_text(textwrap.dedent(RECORDER))
    llm = LLM(
        model=str(target_dir), dtype="float32", device="cpu",
        speculative_config={"method": "custom_class", "custom_class": f"{module}:Recorder", "num_speculative_tokens": 2},
    )
    engine = llm.engine
    recorder_calls = sys.modules[type(engine.speculator.proposer).__module__].CALLS
    prompt = [5, 6, 7, 8]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), request_id="done")
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), request_id="cut")
    outputs: dict[str, list[int]] = {"done": [], "cut": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.delta_token_ids
        if len(outputs["cut"]) >= 8:
            engine.abort_request("cut")
    finish = [c for c in recorder_calls if c[0] == "finish"]
    assert finish == [("finish", "done", prompt + outputs["done"])]
    ends = [c for c in recorder_calls if c[0] in ("finish", "remove", "discard")]
    assert ends == [("finish", "done", prompt + outputs["done"]), ("remove", "done"), ("discard", "cut")]
