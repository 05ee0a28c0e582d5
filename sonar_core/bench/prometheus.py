"""What a benchmark reads from a server's ``/metrics``: the speculative-decoding counters (the
documented ``aphrodite:spec_decode_*`` series) and the process's resident memory."""

from __future__ import annotations

from dataclasses import dataclass

from sonar_core.bench.peers.peer_protocol import SpecCounts

PREFIX = "aphrodite:spec_decode_"


@dataclass
class ServerSnapshot:
    spec: SpecCounts | None  # None: the server exposes no speculative-decoding counters
    resident_memory_bytes: int | None


def parse_metrics(text: str) -> ServerSnapshot:
    """Sum each counter over its labels (one model per server); positions by their label."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    resident = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "process_resident_memory_bytes":
                resident = int(sample.value)
            if not sample.name.startswith(PREFIX) or not sample.name.endswith("_total"):
                continue
            name = sample.name[len(PREFIX) : -len("_total")]
            if name == "num_accepted_tokens_per_pos":
                position = int(sample.labels.get("position", 0))
                per_pos[position] = per_pos.get(position, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    spec = None
    if "num_drafts" in totals:
        width = max(per_pos, default=-1) + 1
        spec = SpecCounts(
            num_drafts=int(totals.get("num_drafts", 0)),
            num_draft_tokens=int(totals.get("num_draft_tokens", 0)),
            num_accepted_tokens=int(totals.get("num_accepted_tokens", 0)),
            accepted_per_pos=[int(per_pos.get(position, 0)) for position in range(width)],
        )
    return ServerSnapshot(spec=spec, resident_memory_bytes=resident)
