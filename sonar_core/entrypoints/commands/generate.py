"""``aphrodite generate [MODEL] --prompt TEXT``: offline generation, completions to stdout."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError

from sonar_core.config import config_error_from_validation, validate_config
from sonar_core.entrypoints.args import add_engine_args, add_model_arg, engine_config_from_args
from sonar_core.plugins import get_plugin_manager
from sonar_core.sampling_params import SamplingParams

NAME = "generate"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        NAME,
        help="Generate completions for prompts and print them.",
        description="Generate a completion for each --prompt with MODEL and print it.",
    )
    add_model_arg(parser)
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--prompt", action="append", required=True, help="A prompt; repeat for several.")
    sampling.add_argument("--chat", action="store_true", help="Wrap each prompt in the model's chat template.")
    sampling.add_argument("--max-tokens", type=int, default=128, help="Tokens to generate (default: 128).")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0).")
    sampling.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass (default: 1).")
    sampling.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens; 0 disables.")
    add_engine_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    engine_config = engine_config_from_args(args)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
        )
    except ValidationError as exc:
        raise config_error_from_validation(exc) from None
    # Fail before the model loads; the engine validates again and logs the warnings then.
    validate_config(engine_config, get_plugin_manager(), log_warnings=False)
    from aphrodite import LLM

    # Statistics are logged unless --disable-log-stats (the Python API's default is the reverse).
    llm = LLM(**{**engine_config.model_dump(exclude_unset=True), "disable_log_stats": engine_config.disable_log_stats})
    if args.chat:
        conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for index, output in enumerate(outputs):
        if len(outputs) > 1:
            print(f"--- completion {index + 1} of {len(outputs)}")
        print(output.outputs[0].text)
    return 0
