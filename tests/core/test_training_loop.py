"""The one training loop (graph_fsdp/training/loop.py) and the GraphPolicy it builds its runner from
(graph_fsdp/capture/policy.py): the whole-step runner driven by the loop on 2 gloo ranks, and
the policy's rules, which the command line applies before launch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from graph_fsdp_testing import TINY_GPT

from graph_fsdp.capture.policy import GraphPolicy, capture_impl
from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy
from graph_fsdp.training.checkpoints import CheckpointPolicy
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run

TINY = TINY_GPT
STATIC = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)


def _loop_and_whole_step(rank: int, world: int, cfg: TrainConfig) -> dict:
    """The usual loop and the loop through the whole-step runner's eager path (the twin of
    its graph), in one process group."""
    with_lr_tensor = run(rank, world, dataclasses.replace(cfg, cuda_graph_optimizer=True))
    return {"loop": run(rank, world, cfg), "whole_step": with_lr_tensor}


def test_whole_step_runner_in_the_loop_trains_like_the_loop() -> None:
    """cuda_graph_optimizer with cuda_graph_impl "none": every microbatch, the clipping and the
    fused AdamW step run inside WholeStepGraph(eager=True), driven by the loop (batches, no_sync
    accumulation, the loss mean, eval). It trains like the loop's own steps; the whole step
    keeps the learning rate as a tensor, whose fused update may round apart from a float's in
    the last bit, hence the fp32 tolerance."""
    cfg = TrainConfig(
        model=TINY,
        steps=3,
        grad_accum=2,
        clip_grad=0.05,
        fused_optimizer=True,
        eval_interval=2,
        cuda_graph_warmup_steps=1,
    )
    for out in spawn(_loop_and_whole_step, 2, cfg):
        loop, whole = out["loop"], out["whole_step"]
        report = whole["cuda_graphs"]
        assert report["whole_step"] and report["impl"] == "eager", report
        assert report["policy"]["clip_grad"] == 0.05 and report["microbatches"] == 2
        assert "cuda_graphs" not in loop
        torch.testing.assert_close(whole["losses"], loop["losses"], rtol=1e-6, atol=0)
        torch.testing.assert_close(whole["eval_losses"], loop["eval_losses"], rtol=1e-6, atol=0)
        for name, value in loop["params"].items():
            torch.testing.assert_close(whole["params"][name], value, rtol=1e-5, atol=1e-7)
        assert loop["losses"][0] == whole["losses"][0]  # before any update: the same bits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(impl="graph"), "cuda_graph_impl='graph': choose one of none, te, torch"),
        (dict(impl="te", scopes=("full_iteration",)), "captured with torch.cuda graphs"),
        (dict(impl="torch", scopes=("attn", "full_iteration")), "cannot be combined"),
        (dict(impl="torch", verify="loud"), "verify='loud'"),
        (dict(impl="torch", scopes=("attn",), optimizer=True), "scopes are attn"),
        (dict(impl="torch", optimizer=True), "scopes are layer"),
        (dict(impl="none", scopes=("attn",), optimizer=True), "scopes are attn"),
        (
            dict(impl="torch", scopes=("full_iteration",), optimizer=True, verify=True),
            "--cuda-graph-verify checks",
        ),
    ],
)
def test_graph_policy_refuses(kwargs, match) -> None:
    with pytest.raises(GraphConfigError, match=match):
        GraphPolicy(**kwargs)


def test_graph_policy_rules_against_the_run() -> None:
    layer = GraphPolicy(impl="torch", warmup_steps=2)
    with pytest.raises(GraphConfigError, match="must be static"):
        layer.check_config(BufferPolicy())
    with pytest.raises(GraphConfigError, match=r"re-runs layer forwards.*recompute=True"):
        layer.check_config(STATIC, recompute=True)
    with pytest.raises(GraphConfigError, match="--train-iters 2 must exceed"):
        layer.check_steps(2, given="--train-iters 2")
    layer.check_config(STATIC, steps=3)
    full = GraphPolicy(impl="torch", scopes=("full_iteration",))
    with pytest.raises(GraphConfigError, match="full_iteration replays FSDP's buffer hand-offs"):
        full.check_config(BufferPolicy(persist_on_alloc_fail=True))
    full.check_config(BufferPolicy(allocator="trace_pool"), recompute=True)  # whole graphs
    # Eager: nothing to check, no runner.
    eager = GraphPolicy()
    eager.check_config(BufferPolicy(), recompute=True, steps=0)
    assert eager.build(torch.nn.Linear(2, 2)) is None
    # The whole step: a fused optimizer on the device, given to build().
    whole = GraphPolicy(impl="torch", scopes=("full_iteration",), optimizer=True)
    with pytest.raises(GraphConfigError, match="needs AdamW\\(fused=True\\)"):
        whole.check_optimizer(fused=False)
    with pytest.raises(GraphConfigError, match="--optimizer-cpu-offload"):
        whole.check_optimizer(fused=True, offload_fraction=0.5)
    whole.check_optimizer(fused=True)
    with pytest.raises(GraphConfigError, match="pass build\\(..., optimizer="):
        whole.build(torch.nn.Linear(2, 2))
    # full_iteration is captured with torch graphs whatever the layerwise backend.
    assert capture_impl("te", ["full_iteration"]) == "torch"
    assert capture_impl("te", ["attn"]) == "te" and capture_impl("none", ["attn"]) == "none"


def test_train_config_holds_its_graph_policy() -> None:
    cfg = TrainConfig(
        cuda_graph_impl="torch",
        cuda_graph_scope=["attn", "mlp"],
        cuda_graph_warmup_steps=3,
        cuda_graph_comm=False,
        cuda_graph_scope_modules={"attn": ["attn"]},
    )
    policy = cfg.graph_policy
    assert policy == GraphPolicy(
        impl="torch",
        scopes=("attn", "mlp"),
        warmup_steps=3,
        comm_graphs=False,
        scope_modules={"attn": ["attn"]},
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.impl = "te"


FLAT = [
    # (flat spelling, its value, the section's field, the value there)
    ("bf16", True, "mp.param_dtype", torch.bfloat16),
    ("grad_comm_dtype", "bf16", "mp.grad_comm_dtype", torch.bfloat16),
    ("reduce_scatter_fp32_accumulation", True, "mp.reduce_scatter_fp32_accumulation", True),
    ("save_path", "/ck", "checkpoint.save_path", "/ck"),
    ("save_at", 3, "checkpoint.save_at", 3),
    ("save_interval", 2, "checkpoint.save_interval", 2),
    ("save_keep_last", 1, "checkpoint.keep_last", 1),
    ("save_on_interrupt", True, "checkpoint.save_on_interrupt", True),
    ("load_path", "/ck", "checkpoint.load_path", "/ck"),
    ("resume_optimizer_settings", "config", "checkpoint.resume_optimizer_settings", "config"),
]


def _section_field(cfg: TrainConfig, spelling: str):
    section, name = spelling.split(".")
    return getattr(getattr(cfg, section), name)


@pytest.mark.parametrize(("old", "value", "new", "stored"), FLAT, ids=[f[0] for f in FLAT])
def test_flat_spellings_fold_into_their_section(old, value, new, stored) -> None:
    """The mixed-precision and checkpoint fields moved into ``mp`` and ``checkpoint``: the
    flat spelling still works in the constructor, ``dataclasses.replace`` and as an
    attribute, each time with a DeprecationWarning naming the section's field."""
    message = f"LoopConfig.{old} is deprecated: use LoopConfig.{new}"
    extra = {"mp": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if old != "bf16" else {}
    with pytest.warns(DeprecationWarning, match=message):
        made = TrainConfig(**extra, **{old: value})
    with pytest.warns(DeprecationWarning, match=message):
        replaced = dataclasses.replace(TrainConfig(**extra), **{old: value})
    for cfg in (made, replaced):
        assert _section_field(cfg, new) == stored
        with pytest.warns(DeprecationWarning, match=message):
            assert getattr(cfg, old) == value
    # The other fields of the section it folds into are kept.
    if extra:
        assert made.mp.param_dtype == replaced.mp.param_dtype == torch.bfloat16


def test_sections_refuse_what_they_cannot_train() -> None:
    with pytest.raises(ValueError, match=r"mp.param_dtype=torch.float16 .* torch.bfloat16"):
        TrainConfig(mp=MixedPrecisionPolicy(param_dtype=torch.float16))
    with pytest.raises(TypeError, match=r"checkpoint=.* must be a CheckpointPolicy"):
        TrainConfig(checkpoint={"save_path": "/ck"})
    with pytest.raises(ValueError, match="resume_optimizer_settings='keep'"):
        CheckpointPolicy(resume_optimizer_settings="keep")
    with pytest.raises(ValueError, match=r"save_interval=-1 must be an int >= 0"):
        CheckpointPolicy(save_interval=-1)
    with pytest.raises(ValueError, match=r"keep_last=0 must be an int >= 1"):
        CheckpointPolicy(keep_last=0)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(ValueError, match="grad_comm_dtype='fp16'"),
    ):
        TrainConfig(grad_comm_dtype="fp16")


def test_checkpoint_policy_says_when_to_save() -> None:
    """After this run's ``save_at`` steps, every ``save_interval`` iterations, at a stop with
    ``save_on_interrupt`` - and never without ``save_path``."""
    policy = CheckpointPolicy(save_path="/ck", save_at=4, save_interval=3)
    saved = [i for i in range(11, 17) if policy.saves_after(i, start_step=10, stopping=False)]
    assert saved == [12, 14, 15]
    assert not policy.saves_after(13, start_step=10, stopping=True)
    stop = dataclasses.replace(policy, save_on_interrupt=True)
    assert stop.saves_after(13, start_step=10, stopping=True)
    nowhere = dataclasses.replace(stop, save_path=None)
    assert not any(nowhere.saves_after(i, start_step=10, stopping=True) for i in range(11, 17))
