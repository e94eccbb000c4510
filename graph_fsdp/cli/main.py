"""``graph-fsdp``: train, compare eager vs graphed, benchmark against peers, profile.

    graph-fsdp train   --num-layers 2 --hidden-size 32 --num-attention-heads 4 --train-iters 5
    graph-fsdp compare --cuda-graph-impl te --scopes "" --scopes "attn" --fsdp-double-buffer \\
                       --fsdp-db-use-persist-buf-on-alloc-fail --bf16
    graph-fsdp compare --reference-strategy no_shard          # CPU: strategy vs strategy
    graph-fsdp bench   --bf16 --cuda-graph-impl te --scopes "" --scopes attn ...
    graph-fsdp profile --train-iters 3

Without a launcher every command spawns its local ranks (all GPUs, or ``--nproc`` gloo
processes on CPU); under ``torchrun`` each process runs its own rank. Ctrl-C (SIGINT) or
SIGTERM stops the ranks at the next step boundary (a second one: at once); the command then
exits with 130 (143 for SIGTERM). A failing rank is reported in one line that names the log
holding every rank's traceback (--verbose: the tracebacks on screen).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

import graph_fsdp
from graph_fsdp.cli import bench_cmd, compare_cmd, profile_cmd, train_cmd
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.graph_options import apply_megatron_graph_spellings
from graph_fsdp.cli.options import add_common_args
from graph_fsdp.distributed import TIMEOUT_ENV
from graph_fsdp.training.supervision import VERBOSE_ENV, Interrupted, RankFailure


class _Parser(argparse.ArgumentParser):
    """argparse with no abbreviated flags (``--num-layer`` is not ``--num-layers``) whose errors
    come first, followed by one usage line (a command's full usage is dozens of lines: ``--help``
    shows it). The subcommands' parsers are of this class too (``add_subparsers``' default)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if self._subparsers is None:  # a command's parser: its usage is long
            usage = f"usage: {self.prog} [flags] ({self.prog} --help lists them)"
        else:
            usage = self.format_usage().strip()
        self.exit(2, f"{self.prog}: error: {message}\n{usage}\n")

    def refuse_unknown(self, extra: list[str]) -> None:
        """``unrecognized arguments``, naming the nearest flag of this command for a typo."""
        known = [s for action in self._actions for s in action.option_strings]
        hints = {}
        for word in extra:
            flag = word.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if flag.startswith("--") and close:
                hints[flag] = close[0]
        if len(hints) == 1:
            hint = f" (did you mean {next(iter(hints.values()))}?)"
        else:
            hint = "".join(f"; {flag}: did you mean {near}?" for flag, near in hints.items())
        self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Docstrings keep their line breaks; a flag's help ends with its default when it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="graph-fsdp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=f"graph-fsdp {graph_fsdp.__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        p = sub.add_parser(
            name, help=module.HELP, formatter_class=_Formatter, description=module.__doc__
        )
        add_common_args(p, **module.COMMON_FLAGS)
        module.add_args(p)
        p.set_defaults(handler=module.main, subparser=p)
    return parser


COMMANDS = {"train": train_cmd, "compare": compare_cmd, "bench": bench_cmd, "profile": profile_cmd}
"""The subcommands, by name: each module's HELP, COMMON_FLAGS, add_args and main."""


def _apply_distributed_timeout(args: argparse.Namespace) -> None:
    """--distributed-timeout-minutes (Megatron's spelling) as the process groups' timeout,
    which the ranks and the launcher read from the environment (graph_fsdp/distributed.py)."""
    minutes = getattr(args, "distributed_timeout_minutes", None)
    if minutes is None:
        return
    if not 0 < minutes < float("inf"):
        raise CLIError(
            f"--distributed-timeout-minutes {minutes:g} must be a number of minutes > 0 "
            "(e.g. 10; fractions are allowed: 0.5 is 30 s)"
        )
    os.environ[TIMEOUT_ENV] = f"{minutes * 60:g}"


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit code.

    A rejected flag combination exits with status 2 and one line, ``graph-fsdp <command>:
    error: ...`` (argparse's own syntax errors add one usage line). A failed or hung rank:
    status 1 and one line; a stop signal: 128 + its number.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "subparser", parser).refuse_unknown(extra)
    args.argv = argv
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"  # read by the launcher (graph_fsdp/training/supervision.py)
    try:
        _apply_distributed_timeout(args)
        apply_megatron_graph_spellings(args)
        return args.handler(args)
    except CLIError as err:
        print(f"graph-fsdp {args.command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except RankFailure as err:
        # On a line of its own: a killed rank 0 leaves its progress bar unfinished.
        print(f"\ngraph-fsdp {args.command}: {err}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        lead = "\n" if stop.forced else ""
        print(f"{lead}graph-fsdp {args.command}: {stop.describe()}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:  # before or after the ranks ran (e.g. while checking flags)
        print(f"graph-fsdp {args.command}: interrupted by SIGINT", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
