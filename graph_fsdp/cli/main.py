"""``graph-fsdp``: train, compare eager vs graphed, benchmark against peers, profile.

    graph-fsdp train   --num-layers 2 --hidden-size 32 --num-attention-heads 4 --train-iters 5
    graph-fsdp compare --cuda-graph-impl te --scopes "" --scopes "attn" --fsdp-double-buffer \\
                       --fsdp-db-use-persist-buf-on-alloc-fail --bf16
    graph-fsdp compare --reference-strategy no_shard          # CPU: strategy vs strategy
    graph-fsdp bench   --bf16 --cuda-graph-impl te --scopes "" --scopes attn ...
    graph-fsdp profile --train-iters 3

Without a launcher every command spawns its local ranks (all GPUs, or ``--nproc`` gloo
processes on CPU); under ``torchrun`` each process runs its own rank.
"""

from __future__ import annotations

import argparse
import sys

from graph_fsdp.cli import bench_cmd, compare_cmd, profile_cmd, train_cmd
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.launch import RankFailure


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Docstrings keep their line breaks; a flag's help ends with its default when it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graph-fsdp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (train_cmd, compare_cmd, bench_cmd, profile_cmd):
        module.add_parser(sub, _Formatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit code.

    A rejected flag combination exits with status 2 and ``graph-fsdp <command>: error: ...``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.handler(args)
    except CLIError as err:
        args.subparser.error(str(err))  # exits with status 2
    except RankFailure as err:
        print(f"graph-fsdp {args.command}: failed\n{err}", file=sys.stderr)
        return 1
    return 1  # not reached: parser.error exits


if __name__ == "__main__":
    sys.exit(main())
