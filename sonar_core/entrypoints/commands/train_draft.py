"""``aphrodite train-draft [MODEL] --method METHOD --output DIR``: train a draft head for a target
from the target's own answers, in the layout its plugin loads (docs/training.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sonar_core.entrypoints.args import add_model_arg
from sonar_core.errors import ConfigError
from sonar_core.training.methods import LABEL_KINDS, METHODS

NAME = "train-draft"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        NAME,
        help="Train a draft head (eagle3, medusa, mlp_speculator, dflash) for a target from its own answers.",
        description="Generate self-distillation data with the target (its answers and hidden states, through "
        "extract_hidden_states), train a draft head on it, and write the head in the layout its method loads: "
        '{"method": METHOD, "model": OUTPUT}. Every step resumes where it stopped when the same command runs '
        "again. See docs/training.md.",
    )
    add_model_arg(parser)
    parser.add_argument("--method", choices=METHODS, default="eagle3", help="The head to train (default: eagle3).")
    parser.add_argument("--output", type=Path, required=True, help="Folder the trained head is written to.")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="Folder for the data and the resumable training state (default: OUTPUT.work).")
    data = parser.add_argument_group("data")
    data.add_argument("--num-prompts", type=int, default=900, help="Prompts the target answers (default: 900).")
    data.add_argument("--conversation-prompts", type=int, default=0,
                      help="Prompts of the conversation set (everyday requests whose answers copy little) beside "
                           "--num-prompts; more added later extend the same data folder (default: 0).")
    data.add_argument("--generated-prompts", type=int, default=0,
                      help="Prompts the target writes itself (user turns sampled from its chat template: requests on "
                           "far more subjects than the built-in sets) beside the others; written once into the data "
                           "folder, and more added later extend it (default: 0).")
    data.add_argument("--max-tokens", type=int, default=256, help="Most tokens per answer (default: 256).")
    data.add_argument("--max-num-seqs", type=int, default=24, help="Answers generated at once (default: 24).")
    data.add_argument("--dtype", default="auto", help="The target's dtype while answering (default: auto).")
    head = parser.add_argument_group("head")
    head.add_argument("--num-speculative-tokens", type=int, default=3,
                      help="Draft tokens per step the head is trained for: EAGLE-3's unrolled steps, Medusa's heads, "
                      "the MLP speculator's stages, a DFlash block's drafts (default: 3).")
    head.add_argument("--draft-vocab-size", type=int, default=4096,
                      help="Tokens an eagle3 or medusa head scores, the most frequent in the answers (default: 4096).")
    head.add_argument("--num-layers", type=int, default=1, help="Draft decoder layers of eagle3 and dflash (default: 1).")
    head.add_argument("--intermediate-size", type=int, default=None,
                      help="MLP width of those layers (default: the target's).")
    training = parser.add_argument_group("training")
    training.add_argument("--init-from", type=Path, default=None,
                          help="eagle3: start from a head written earlier (a speculators folder) instead of random "
                               "weights, to fine-tune it on new data; with a larger --num-layers the earlier head "
                               "grows, its added layers starting as identities.")
    training.add_argument("--labels", choices=LABEL_KINDS, default="choice",
                          help="What the head learns at each position: the target's greedy choice, or its whole "
                               "distribution over the head's vocabulary (soft labels) (default: choice).")
    training.add_argument("--epochs", type=int, default=4, help="Passes over the data (default: 4).")
    training.add_argument("--learning-rate", type=float, default=1e-3, help="Peak learning rate (default: 1e-3).")
    training.add_argument("--batch-rows", type=int, default=1024, help="Positions per step (default: 1024).")
    training.add_argument("--max-rows", type=int, default=640, help="Most positions read from one answer (default: 640).")
    training.add_argument("--save-every", type=int, default=25, help="Steps between resumable saves (default: 25).")
    training.add_argument("--stop-after-steps", type=int, default=None,
                          help="Stop after this many training steps (resumable; no head is written until the end).")
    training.add_argument("--seed", type=int, default=0, help="Seed of the prompts, data order and weights (default: 0).")
    training.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core).")
    training.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                          help="dtype of the written weights (default: float32).")
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval-prompts", type=int, default=32,
                            help="Held-out prompts to measure acceptance on; 0 skips it (default: 32).")
    evaluation.add_argument("--eval-max-tokens", type=int, default=128, help="Tokens per held-out answer (default: 128).")
    parser.add_argument("--no-progress", action="store_true", help="No progress bars.")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from sonar_core.training.pipeline import run as run_recipe

    report = run_recipe(_recipe(args), progress=not args.no_progress, stop_after=args.stop_after_steps)
    print(json.dumps({"method": report.method, "output": report.output, "timings_s": report.timings,
                      "data": report.data, "training": report.training, "evaluation": report.evaluation}, indent=2))
    return 0


def _recipe(args: argparse.Namespace) -> Any:
    from sonar_core.config import TargetInfo
    from sonar_core.spec_decode.layer_ids import eagle3_default_layers
    from sonar_core.training.data import DataSpec
    from sonar_core.training.loop import TrainSettings
    from sonar_core.training.methods.base import HeadOptions
    from sonar_core.training.pipeline import DraftRecipe

    for name in ("num_prompts", "max_tokens", "max_num_seqs", "num_speculative_tokens", "draft_vocab_size",
                 "num_layers", "epochs", "batch_rows", "max_rows", "save_every"):
        if getattr(args, name) < 1:
            raise ConfigError(name, f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}",
                              "pass a positive number")
    for name in ("conversation_prompts", "generated_prompts"):
        if getattr(args, name) < 0:
            raise ConfigError(name, f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}",
                              "pass 0 or more")
    num_layers = TargetInfo.from_model(args.model).num_layers or 0
    layers = tuple(dict.fromkeys(k for k in eagle3_default_layers(num_layers) if 0 < k <= num_layers))
    output = args.output.expanduser()
    return DraftRecipe(
        method=args.method,
        output=output,
        work_dir=(args.work_dir or output.with_name(output.name + ".work")).expanduser(),
        data=DataSpec(model=args.model, num_prompts=args.num_prompts, max_tokens=args.max_tokens, seed=args.seed,
                      dtype=args.dtype, layer_ids=layers, max_num_seqs=args.max_num_seqs,
                      conversation_prompts=args.conversation_prompts, generated_prompts=args.generated_prompts),
        head=HeadOptions(depth=args.num_speculative_tokens, draft_vocab_size=args.draft_vocab_size,
                         num_layers=args.num_layers, intermediate_size=args.intermediate_size, labels=args.labels),
        settings=TrainSettings(epochs=args.epochs, learning_rate=args.learning_rate, batch_rows=args.batch_rows,
                               max_rows=args.max_rows, seed=args.seed, save_every=args.save_every),
        eval_prompts=args.eval_prompts,
        eval_max_tokens=args.eval_max_tokens,
        save_dtype=args.save_dtype,
        init_from=args.init_from.expanduser() if args.init_from else None,
    )
