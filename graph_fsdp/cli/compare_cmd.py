"""``graph-fsdp compare``: are graphed runs bit-identical to the eager run?

    graph-fsdp compare --bf16 --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail \\
        --cuda-graph-impl te --scopes "" --scopes "attn" --scopes "attn mlp"
    graph-fsdp compare --reference-strategy no_shard    # CPU: ZeRO-3 vs DDP, both eager

Every run uses the same seeds, data and shapes, and deterministic algorithms
(``--deterministic`` is on by default here, ``--no-deterministic`` turns it off: flash-attention
backward is otherwise nondeterministic, so not even two eager runs would match). Per compared
run it prints whether every step's loss and the final full parameters are bit-identical
(``torch.equal``) to the reference, else the first differing step and the largest difference.
Every graphed run also verifies its first graphed step (``TrainConfig.graphs.verify``,
graph_fsdp/capture/verify.py): the step runs eagerly and replayed from the same state, and a
difference names the first module whose forward output differs.
A graphed run is IDENTICAL only if its graphs replayed: ``NOT GRAPHED`` when it reports no
graphs, zero replays or fewer replays than graphed steps, ``FELL BACK`` when a captured
module ran eagerly, ``NOT VERIFIED`` when its verification step replayed nothing, and
``COMMUNICATION GRAPHS failed`` when its communication graphs failed - equal numbers from an
eager run prove nothing about graphs. Exit status 1 when any run is not IDENTICAL. The header
and ``--log-json`` name the git commit (graph_fsdp/bench/provenance.py). Without CUDA no graph can be captured, so on CPU the
reference is an eager run of ``--reference-strategy`` and the compared run an eager run of
``--data-parallel-sharding-strategy``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from graph_fsdp.bench.provenance import code_version, stamp_line
from graph_fsdp.bench.verdicts import graph_verdict
from graph_fsdp.capture.policy import capture_impl
from graph_fsdp.capture.scopes import scope_label
from graph_fsdp.cli import mcore
from graph_fsdp.cli.errors import CLIError
from graph_fsdp.cli.graph_options import add_scope_sets_arg, scope_sets_from
from graph_fsdp.cli.options import resolve
from graph_fsdp.fsdp.api import STRATEGIES
from graph_fsdp.integrations.megatron.train import MCoreTrainConfig
from graph_fsdp.integrations.megatron.train import run as run_mcore
from graph_fsdp.training.loop import LoopConfig
from graph_fsdp.training.processes import launch
from graph_fsdp.training.train import TrainConfig, run

HELP = "Check eager vs graphed (or strategy vs strategy) runs for bit-exactness."
"""The command's line in ``graph-fsdp --help``."""
COMMON_FLAGS = dict(iters_default=10, iters_help="Steps of every run.", deterministic_default=True)
"""How the shared flags (options.add_common_args) read in this command."""


def add_args(p: argparse.ArgumentParser) -> None:
    """The flags of this command alone (main.build_parser adds the shared ones first)."""
    g = p.add_argument_group("comparison")
    add_scope_sets_arg(g)
    g.add_argument(
        "--reference-strategy",
        choices=STRATEGIES,
        default=None,
        help="Reference = an eager run of this strategy (instead of the eager run of "
        "--data-parallel-sharding-strategy). With --cuda-graph-impl none this "
        "compares two eager strategies, which works on CPU.",
    )
    g.add_argument(
        "--log-json", default=None, metavar="PATH", help="Write the verdicts as JSON to PATH."
    )
    # Testing aid: scale the compared runs' lr by (1 + REL) so a difference must be detected.
    g.add_argument(
        "--inject-difference",
        type=float,
        nargs="?",
        const=1e-4,
        default=0.0,
        metavar="REL",
        help=argparse.SUPPRESS,
    )
    mcore.add_megatron_model_args(p)  # --model mcore-gpt|mcore-moe: cli/mcore.py


def run_any(rank: int, world_size: int, cfg: LoopConfig) -> dict:
    """The one training loop for either family's config."""
    if isinstance(cfg, MCoreTrainConfig):
        return run_mcore(rank, world_size, cfg)
    return run(rank, world_size, cfg)


GRAPH_REPORT_KEY = "cuda_graphs"
"""Key of ``train.run``'s result that describes what was captured (absent: nothing said)."""


def run_label(cfg: TrainConfig) -> str:
    graphs = cfg.graphs
    if not graphs.enabled:
        return f"{cfg.strategy} eager{' (whole-step API)' if graphs.optimizer else ''}"
    return f"{cfg.strategy} {graphs.impl} [{scope_label(graphs.scopes, graphs.optimizer)}]"


def diff_runs(ref: dict, other: dict, start_step: int = 0) -> dict:
    """Bitwise comparison of two ``train.run`` results (losses, eval losses, full params)."""
    out: dict = {"identical": True}
    a = torch.tensor(ref["losses"], dtype=torch.float64)
    b = torch.tensor(other["losses"], dtype=torch.float64)
    out["steps"] = len(a)
    if a.shape != b.shape:
        out.update(identical=False, loss_note=f"{len(a)} vs {len(b)} steps")
    else:
        unequal = (a != b) | a.isnan() | b.isnan()
        out["equal_steps"] = int((~unequal).sum())
        if unequal.any():
            i = int(unequal.nonzero()[0, 0])
            out.update(
                identical=False,
                first_diff_step=start_step + i,
                first_diff=(float(a[i]), float(b[i])),
                max_loss_diff=float((a - b).abs().nan_to_num(float("inf")).max()),
            )
    ea, eb = ref.get("eval_losses", []), other.get("eval_losses", [])
    if ea != eb:
        out.update(identical=False, eval_differs=True)
    pa, pb = ref.get("params", {}), other.get("params", {})
    if set(pa) != set(pb):
        out.update(
            identical=False, param_note=f"parameter names differ: {sorted(set(pa) ^ set(pb))}"
        )
        return out
    differing = [n for n in pa if not torch.equal(pa[n], pb[n])]
    out["params"] = len(pa)
    out["differing_params"] = len(differing)
    if differing:
        diffs = {n: float((pa[n].double() - pb[n].double()).abs().max()) for n in differing}
        worst = max(diffs, key=diffs.get)
        out.update(identical=False, max_param_diff=diffs[worst], worst_param=worst)
    return out


def add_verification(verdict: dict, other: dict) -> None:
    """The graphed run's step verification (graphed vs eager, first differing module); a
    check whose graphed run replayed nothing is NOT VERIFIED (verify.py)."""
    checks = (other.get(GRAPH_REPORT_KEY) or {}).get("verification", [])
    verdict["verification"] = [c["summary"] for c in checks]
    unverified = [c for c in checks if not c.get("verified", False)]
    if unverified and "graph_failure" not in verdict:
        c = unverified[0]
        why = (
            f"{c['fallbacks']} eager fallbacks"
            if c.get("replays", 0) and c.get("fallbacks")
            else "0 replays"
        )
        verdict["graph_failure"] = f"NOT VERIFIED: its verification step's graphed run had {why}"
    flagged = [c for c in checks if not c["identical"] and c.get("verified", False)]
    if unverified or flagged:
        verdict["identical"] = False
    if flagged:
        verdict["first_differing_module"] = flagged[0].get("first_module")


def add_graph_check(verdict: dict, other: dict, cfg: TrainConfig) -> None:
    """A graphed run's captures, replays, fallbacks and communication graphs; one whose
    graphs did not replay as configured is not IDENTICAL, whatever its numbers
    (bench/verdicts.py [Note: graphed rows must replay])."""
    if not cfg.graphs.enabled:
        return
    fields, failure = graph_verdict(
        other.get(GRAPH_REPORT_KEY),
        timed_steps=max(cfg.steps - cfg.graphs.warmup_steps, 1),
        comm_requested=cfg.graphs.comm_graphs,
    )
    verdict.update(fields)
    if failure is not None:
        verdict.update(identical=False, graph_failure=failure)


def format_verdict(label: str, v: dict) -> str:
    warning = f"\n  {'':<44} warning: {v['warning']}" if v.get("warning") else ""
    if "graph_replays" in v:
        warning += f"\n  {'':<44} graphs: {_graph_counts(v)}"
    warning += "".join(f"\n  {'':<44} verify: {line}" for line in v.get("verification", []))
    if v.get("graph_failure"):
        same = v.get("equal_steps") == v.get("steps") and not v.get("differing_params")
        numbers = "numbers equal the reference" if same else "numbers differ from the reference"
        return f"  {label:<44} {v['graph_failure']} ({numbers}){warning}"
    if v["identical"]:
        return (
            f"  {label:<44} IDENTICAL  losses {v['equal_steps']}/{v['steps']} steps and final "
            f"params {v['params']}/{v['params']} tensors bit-identical{warning}"
        )
    parts = []
    if "first_diff_step" in v:
        x, y = v["first_diff"]
        parts.append(
            f"first differing step {v['first_diff_step']}: loss {x:.9g} vs {y:.9g}; "
            f"max loss |diff| {v['max_loss_diff']:.3g}"
        )
    elif "loss_note" in v:
        parts.append(f"losses: {v['loss_note']}")
    else:
        parts.append(f"losses {v['equal_steps']}/{v['steps']} steps bit-identical")
    if v.get("eval_differs"):
        parts.append("eval losses differ")
    if "first_differing_module" in v:
        first = v["first_differing_module"] or "no module output (outputs or gradients)"
        parts.append(f"step verification flags a difference, first at {first}")
    if "param_note" in v:
        parts.append(v["param_note"])
    elif v.get("differing_params"):
        parts.append(
            f"params {v['differing_params']}/{v['params']} tensors differ, max |diff| "
            f"{v['max_param_diff']:.3g} ({v['worst_param']})"
        )
    return f"  {label:<44} DIFFERENT  " + "; ".join(parts) + warning


def _graph_counts(v: dict) -> str:
    return (
        f"{v['graph_captures']} captures, {v['graph_replays']} replays, "
        f"{v['graph_eager_fallbacks']} eager fallbacks; communication graphs {v['comm_graphs']}"
    )


def summary_line(verdicts: list[dict]) -> str:
    if all(v["identical"] for v in verdicts):
        graphed = any("graph_replays" in v for v in verdicts)
        return "all runs bit-identical" + (
            " (every graphed run replayed, none fell back)" if graphed else ""
        )
    unproven = sum(bool(v.get("graph_failure")) for v in verdicts)
    different = sum(not v["identical"] and not v.get("graph_failure") for v in verdicts)
    parts = [f"{different} run(s) DIFFER from the reference"] if different else []
    if unproven:
        parts.append(f"{unproven} graphed run(s) did not replay as configured")
    return "; ".join(parts)


def compare_worker(
    rank: int, world_size: int, reference: TrainConfig, runs: list[TrainConfig]
) -> list[dict] | None:
    """Run the reference, then each compared run; rank 0 returns one verdict per run."""
    ref = run_any(rank, world_size, reference)
    verdicts = []
    for cfg in runs:
        other = run_any(rank, world_size, cfg)
        if rank == 0:
            verdict = diff_runs(ref, other, cfg.start_step)
            add_graph_check(verdict, other, cfg)
            if cfg.graphs.enabled:
                add_verification(verdict, other)
            verdicts.append(verdict)
        del other
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            torch.cuda.empty_cache()
    return verdicts if rank == 0 else None


def main(args: argparse.Namespace) -> int:
    scope_sets, flag = scope_sets_from(args)
    if args.cuda_graph_impl == "none" and args.reference_strategy is None:
        raise CLIError(
            "nothing to compare: add --cuda-graph-impl te (or torch) to compare eager vs graphed "
            "runs (CUDA), or --reference-strategy STRATEGY to compare two eager strategies "
            "(works on CPU)"
        )
    if args.model == "gpt":
        mcore.reject_mcore_only_flags(args)
        res = resolve(
            args,
            graph_scope_sets=scope_sets,
            scope_flag=flag,
            cpu_hint="on CPU, compare two eager strategies instead: --cuda-graph-impl none "
            "--reference-strategy no_shard",
        )
        plan, base = res.plan, replace(res.cfg, return_params=True)
    else:
        plan, base = mcore.compare_config(args, scope_sets, flag)
    reference = replace(
        base.with_graphs(impl="none", scopes=()),
        strategy=args.reference_strategy or base.strategy,
    )
    lr = base.lr * (1.0 + args.inject_difference)
    if args.cuda_graph_impl == "none":
        runs = [replace(base, lr=lr)]
    else:
        runs = [
            replace(
                base.with_graphs(
                    impl=capture_impl(args.cuda_graph_impl, s),
                    scopes=s,
                    # The whole-step graph has no per-module check; its eager twin is the
                    # reference.
                    verify=not args.cuda_graph_optimizer,
                ),
                lr=lr,
            )
            for s in scope_sets
        ]
    verdicts = launch(plan, compare_worker, reference, runs)
    if verdicts is None:
        return 0
    print(
        f"graph-fsdp compare: reference {run_label(reference)}; {base.steps} steps on "
        f"{plan.describe()}; deterministic algorithms {'on' if base.deterministic else 'off'}"
        + (
            f"; compared runs' lr scaled by 1+{args.inject_difference:g}"
            if args.inject_difference
            else ""
        )
    )
    print(f"code: {stamp_line()}")
    for cfg, v in zip(runs, verdicts):
        print(format_verdict(run_label(cfg), v))
    ok = all(v["identical"] for v in verdicts)
    print(summary_line(verdicts))
    if args.log_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
        with open(args.log_json, "w") as f:
            json.dump(
                {
                    "reference": run_label(reference),
                    "steps": base.steps,
                    "code": code_version(),
                    "results": [{"run": run_label(c), **v} for c, v in zip(runs, verdicts)],
                },
                f,
                indent=2,
            )
    return 0 if ok else 1
