"""Schemathesis fuzzes the server's own OpenAPI schema: no input may cause a 5xx.

Bounded and derandomized (the same cases on every run) so that it fits the default suite; both
schema-conforming (positive) and schema-violating (negative) bodies are sent to every route that takes a body.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from server_live import LiveServer

EXAMPLES_PER_MODE = 25


def test_fuzzing_the_openapi_schema_finds_no_server_error(live: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{live.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics"}
    for operation in operations:
        # Negative data needs something to violate: only the routes with a request body have it.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if len(operation.body) else (GenerationMode.POSITIVE,)
        for mode in modes:

            @settings(
                max_examples=EXAMPLES_PER_MODE,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def no_server_error(case: schemathesis.Case) -> None:
                response = case.call(base_url=live.base_url, timeout=60)
                case.validate_response(response, checks=[not_a_server_error])

            no_server_error()
    live.wait_idle()
