"""torch DTensor tensor parallelism + graph_fsdp on real gloo process groups (4 ranks).

The torchtitan order: ``parallelize_module`` over ``mesh["tp"]`` first, then ``fully_shard``
over ``mesh["dp"]`` of a (dp 2, tp 2) mesh, for graph_fsdp's GPT and a HuggingFace Llama, with
and without sequence parallelism. Each run is compared with a TP-only run (the same plan, no
FSDP) that trains on the same global batch - the data-parallel ranks' microbatches in turn,
each microbatch's gradients brought to the parameters' placements (the ``Partial`` gradients
of the sequence-parallel norms all-reduced over tp, as FSDP2 and graph_fsdp do before the
data-parallel reduction), summed and divided by their number:

- bit for bit (``torch.equal``): every microbatch's loss and the final weights, while the
  clipping threshold is not reached (coefficient 1). The arithmetic is the same: the same
  TP-local GEMMs, the sum of two microbatches' gradients (a + b, in any order), the same
  elementwise AdamW;
- within 1e-6 relative: the clipped global gradient norm - graph_fsdp sums the squares of flat
  shards over dp then tp, torch's DTensor clip per parameter, another order of fp32
  additions - and so the weights of a run where clipping bites (the coefficient differs in
  its last bits);
- checkpoints: saved at dp 2 x tp 2, loaded at dp 4 x tp 1, dp 1 x tp 4, dp 2 x tp 1 and a
  model without TP (the flat, non-TP layout), then saved again: every tensor bit-identical
  through the chain; training resumed at dp 2 x tp 2 is bit-identical to the uninterrupted
  run, at other TP sizes within 1e-5 (TP size changes the GEMMs' split).

Everything runs in one spawn of 4 processes (graph_fsdp.training.processes.spawn).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from graph_fsdp_testing import error_of, tiny_gpt
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from graph_fsdp import fully_shard
from graph_fsdp.fsdp import checkpoint as ckpt
from graph_fsdp.fsdp.checkpoint import full_state_dict
from graph_fsdp.models import (
    build_model,
    parallelize_gpt,
    parallelize_hf_decoder,
    sharding_units,
    synthetic_batch,
)
from graph_fsdp.models.hf import hf_decoder, hf_decoder_layers, hf_family_available
from graph_fsdp.training.processes import spawn

GPT = tiny_gpt(ffn_hidden_size=64)
LLAMA = dict(vocab=128, hidden=32, intermediate=64, layers=2, heads=4, seq=16)
MICRO = 2
"""Microbatches of one global batch (one per data-parallel rank at dp 2)."""
SAVE_AT = 2
TOL_NORM = 1e-6
TOL_TP_SIZE = 1e-5


@dataclass(frozen=True)
class Run:
    model: str = "gpt"
    sequence_parallel: bool = True
    strategy: str | None = "optim_grads_params"
    """None: the TP-only reference (no fully_shard)."""
    mesh: tuple = (("dp", 2), ("tp", 2))
    """Mesh dimensions over the 4 ranks; ``rep`` copies the run (independent replicas)."""
    clip: float = 1e9
    steps: int = 3
    start: int = 0
    save: str | None = None
    load: str | None = None
    tp: bool = True
    optim_over_replicas: bool = False


def _build(run: Run, tp_mesh) -> nn.Module:
    if run.model == "gpt":
        model = build_model(GPT)
        if run.tp:
            parallelize_gpt(model, tp_mesh, sequence_parallel=run.sequence_parallel)
        return model
    model = hf_decoder("llama", **LLAMA, num_key_value_heads=4)  # TP 4 needs 4 K/V heads
    if run.tp:
        parallelize_hf_decoder(model, tp_mesh, sequence_parallel=run.sequence_parallel)
    return model


def _units(model: nn.Module, run: Run) -> list[tuple[nn.Module, bool]]:
    if run.model == "gpt":
        return sharding_units(model)
    return [(layer, True) for layer in hf_decoder_layers(model)]


def _loss(model: nn.Module, run: Run, step: int, micro: int) -> torch.Tensor:
    x, y = synthetic_batch(GPT, 1, step, rank=micro)
    if run.model == "gpt":
        return model(x, y)
    return model(input_ids=x, labels=x).loss


_MESHES: dict[tuple, object] = {}


def _meshes(run: Run):
    """(mesh, its tp sub-mesh, its data-parallel sub-mesh), one mesh per shape per process."""
    names = tuple(n for n, _ in run.mesh)
    if run.mesh not in _MESHES:
        shape = tuple(s for _, s in run.mesh)
        _MESHES[run.mesh] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    mesh = _MESHES[run.mesh]
    dp_names = tuple(n for n in names if n in ("dp", "replicate", "shard"))
    return mesh, mesh["tp"], mesh[dp_names]


def _dp_coordinate(dp_mesh) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number)."""
    if dp_mesh.ndim == 1:
        return dp_mesh.get_local_rank(), dp_mesh.size()
    r, s = dp_mesh.get_local_rank(0), dp_mesh.get_local_rank(1)
    return r * dp_mesh.shape[1] + s, dp_mesh.size()


def _train(run: Run) -> dict:
    mesh, tp_mesh, dp_mesh = _meshes(run)
    model = _build(run, tp_mesh)
    fsdp = run.strategy is not None
    if fsdp:
        kw = dict(mesh=dp_mesh, strategy=run.strategy, optim_over_replicas=run.optim_over_replicas)
        for unit, reshard in _units(model, run):
            fully_shard(unit, reshard_after_forward=reshard, **kw)
        fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if run.load:
        ckpt.load(run.load, model, opt)
    d, dp = _dp_coordinate(dp_mesh) if fsdp else (0, 1)
    accum = MICRO // dp
    losses, norms = [], []
    for step in range(run.start, run.start + run.steps):
        mine = []
        if fsdp:
            for i in range(accum):
                model.set_requires_gradient_sync(i == accum - 1)
                loss = _loss(model, run, step, d * accum + i)
                (loss / accum).backward()
                mine.append(loss.detach())
        else:
            mine = _reference_backward(model, run, step)
        losses.append(_all_losses(torch.stack(mine), (d, dp) if fsdp else None))
        if fsdp:  # routed to graph_fsdp's global norm (grad_norm.py)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip))
        else:
            norms.append(_reference_clip(model, run.clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if run.save and step + 1 == run.start + SAVE_AT:
            ckpt.save(run.save, model, opt)
    params = full_state_dict(model) if fsdp else _full_params(model)
    return {"losses": losses, "norms": torch.stack(norms), "params": params}


def _reference_backward(model: nn.Module, run: Run, step: int) -> list[torch.Tensor]:
    """TP only: the global batch's microbatches in turn; each one's gradients in the
    parameters' placements (Partial -> Replicate: an all-reduce over tp), summed in order,
    divided by their number."""
    losses, acc = [], {}
    params = [p for p in model.parameters() if p.requires_grad]
    for micro in range(MICRO):
        loss = _loss(model, run, step, micro)
        loss.backward()
        losses.append(loss.detach())
        for p in params:
            g = p.grad
            if isinstance(g, DTensor):
                g = g.redistribute(placements=p.placements).to_local()
            acc[p] = g.clone() if micro == 0 else acc[p] + g
            p.grad = None
    for p in params:
        g = acc[p] * (1.0 / MICRO)
        if isinstance(p, DTensor):
            g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        p.grad = g
    return losses


def _reference_clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (the norm of the per-parameter norms, the clamped coefficient)
    over whole gradients: torch's own refuses a mix of DTensor and plain parameters (the
    norms stay plain without sequence parallelism)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = [
        torch.linalg.vector_norm(g.full_tensor() if isinstance(g, DTensor) else g) for g in grads
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        (g._local_tensor if isinstance(g, DTensor) else g).mul_(coef)
    return total


def _all_losses(mine: torch.Tensor, where: tuple[int, int] | None) -> torch.Tensor:
    """Every microbatch's loss of the step, in global order: ``mine`` are data-parallel
    rank d of dp's (the world holds world / dp copies of each; powers of two: exact)."""
    if where is None:
        return mine
    d, dp = where
    out = torch.zeros(MICRO)
    out[d * mine.numel() : (d + 1) * mine.numel()] = mine
    dist.all_reduce(out)
    return out / (dist.get_world_size() // dp)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


# ----------------------------------------------------------------------------- checkpoints
def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole (read by this rank alone)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    return sd


def _chain(root: str) -> dict:
    """Save at dp 2 x tp 2 (N-D layout), load and save again at dp 4 x tp 1, without TP (the
    flat layout), at dp 1 x tp 4: the checkpoints of the chain."""
    first = os.path.join(root, "chain0")
    base = Run(steps=SAVE_AT, save=first)
    _train(base)
    paths, prev = [first], first
    hops = [
        Run(mesh=(("dp", 4), ("tp", 1))),
        Run(mesh=(("dp", 4), ("tp", 1)), tp=False),
        Run(mesh=(("dp", 1), ("tp", 4))),
    ]
    for i, hop in enumerate(hops, 1):
        path = os.path.join(root, f"chain{i}")
        mesh, tp_mesh, dp_mesh = _meshes(hop)
        model = _build(hop, tp_mesh)
        for unit, reshard in _units(model, hop):
            fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=dp_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        ckpt.load(prev, model, opt)
        ckpt.save(path, model, opt)
        paths.append(path)
        prev = path
    dist.barrier()
    return {p: _read_checkpoint(p) for p in paths} if dist.get_rank() == 0 else {}


def _resumes(root: str) -> dict:
    saved = os.path.join(root, "uninterrupted")
    out = {"uninterrupted": _train(Run(steps=4, save=saved))}
    for label, run in {
        "dp2xtp2": Run(),
        "dp2xtp1": Run(mesh=(("rep", 2), ("dp", 2), ("tp", 1))),
        "dp1xtp4": Run(mesh=(("dp", 1), ("tp", 4))),
        "dp2 no TP": Run(mesh=(("rep", 2), ("dp", 2), ("tp", 1)), tp=False),
    }.items():
        out[label] = _train(replace(run, start=SAVE_AT, steps=2, load=saved))
    return out


# ----------------------------------------------------------------------------- the spawn
RUNS: dict[str, Run] = {
    "gpt sp": Run(),
    "gpt sp ref": Run(strategy=None),
    "gpt sp optim": Run(strategy="optim"),
    "gpt sp no_shard": Run(strategy="no_shard"),
    "gpt": Run(sequence_parallel=False),
    "gpt ref": Run(sequence_parallel=False, strategy=None),
    "gpt sp clip": Run(clip=0.5),
    "gpt sp clip ref": Run(clip=0.5, strategy=None),
    "gpt sp hsdp": Run(mesh=(("replicate", 2), ("shard", 1), ("tp", 2))),
    "gpt sp hsdp optim_over_replicas": Run(
        mesh=(("replicate", 2), ("shard", 1), ("tp", 2)), optim_over_replicas=True
    ),
    "llama sp": Run(model="llama"),
    "llama sp ref": Run(model="llama", strategy=None),
    "llama": Run(model="llama", sequence_parallel=False),
    "llama ref": Run(model="llama", sequence_parallel=False, strategy=None),
}


def _four_ranks(rank: int, world: int, root: str) -> dict:
    out = {"runs": {label: _train(run) for label, run in RUNS.items()}}
    out["resume"] = _resumes(root)
    out["chain"] = _chain(root)
    out["errors"] = _errors()
    out["untouched"] = _untouched_losses()
    out["init"] = _init_paths()
    return out


def _sharded_gpt(meta: bool = False) -> nn.Module:
    run = Run()
    _, tp_mesh, dp_mesh = _meshes(run)
    model = build_model(GPT, device="meta" if meta else None)
    parallelize_gpt(model, tp_mesh)
    for unit, reshard in sharding_units(model):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=dp_mesh)


def _init_paths() -> dict:
    """The global weights reached through meta-device init, ``iter_full_params`` and
    ``load_state_dict`` of a plain model's (global) state dict."""
    from graph_fsdp import iter_full_params

    plain = build_model(GPT).state_dict()
    loaded = _sharded_gpt()
    with torch.no_grad():
        for p in loaded.parameters():
            p.zero_()
    loaded.load_state_dict(plain)
    return {
        "plain": plain,
        "direct": full_state_dict(_sharded_gpt()),
        "meta": full_state_dict(_sharded_gpt(meta=True)),
        "iter": dict(iter_full_params(_sharded_gpt())),
        "load_state_dict": full_state_dict(loaded),
    }


def test_meta_init_iter_full_params_and_global_state_dict_load(results):
    for res in results:
        init = res["init"]
        for path in ("direct", "meta", "iter", "load_state_dict"):
            assert sorted(init[path]) == sorted(init["plain"]), path
            for name, value in init["plain"].items():
                assert torch.equal(init[path][name], value), (path, name)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    if not hf_family_available("llama"):
        pytest.skip("transformers lacks Llama")
    return spawn(_four_ranks, 4, str(tmp_path_factory.mktemp("tp")))


# ----------------------------------------------------------------------------- the checks
PAIRS = [
    ("gpt sp", "gpt sp ref"),
    ("gpt sp optim", "gpt sp ref"),
    ("gpt sp no_shard", "gpt sp ref"),
    ("gpt", "gpt ref"),
    ("gpt sp hsdp", "gpt sp ref"),
    ("gpt sp hsdp optim_over_replicas", "gpt sp ref"),
    ("llama sp", "llama sp ref"),
    ("llama", "llama ref"),
]


@pytest.mark.parametrize(("label", "ref"), PAIRS)
def test_tp_fsdp_bit_identical_to_tp_only(results, label, ref):
    for rank, res in enumerate(results):
        run, want = res["runs"][label], res["runs"][ref]
        for step, (a, b) in enumerate(zip(run["losses"], want["losses"], strict=True)):
            assert torch.equal(a, b), f"{label} rank {rank} step {step}: {a} vs {b}"
        assert sorted(run["params"]) == sorted(want["params"])
        for name, value in want["params"].items():
            assert torch.equal(run["params"][name], value), f"{label} rank {rank}: {name}"
        torch.testing.assert_close(run["norms"], want["norms"], rtol=TOL_NORM, atol=0)


def test_clipped_norms_and_weights_within_fp32(results):
    """Clipping bites (norm > 0.5): the norms agree to fp32 summation order, the weights too."""
    for res in results:
        run, want = res["runs"]["gpt sp clip"], res["runs"]["gpt sp clip ref"]
        assert (want["norms"] > 0.5).all()
        torch.testing.assert_close(run["norms"], want["norms"], rtol=TOL_NORM, atol=0)
        for name, value in want["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=0, atol=TOL_NORM)
        unclipped = res["runs"]["gpt sp"]["params"]
        moved = max((unclipped[n] - v).abs().max().item() for n, v in want["params"].items())
        assert moved > 1e-4, moved


def test_sequence_parallel_norm_gradients_reduced_over_tp(results):
    """Without the tp all-reduce of the norms' Partial gradients each TP rank would step its
    own norm weights: they stay equal across TP ranks and differ from their initial ones."""
    for res in results:
        params = res["runs"]["gpt sp"]["params"]
        norm = params["layers.0.self_attention.norm.weight"]
        assert not torch.equal(norm, torch.ones_like(norm))
    first = results[0]["runs"]["gpt sp"]["params"]
    for res in results[1:]:
        for name, value in res["runs"]["gpt sp"]["params"].items():
            assert torch.equal(value, first[name]), name


def test_tp_plan_matches_the_model_without_tp(results):
    """The plans compute the model: the first step's losses equal those of the plain model
    (fp32 tolerance: the TP GEMMs are split)."""
    for res in results:
        for label, plain in res["untouched"].items():
            first = res["runs"][label]["losses"][0]
            torch.testing.assert_close(first, plain, rtol=1e-6, atol=1e-6)


def _untouched_losses() -> dict[str, torch.Tensor]:
    out = {}
    for label in ("gpt sp ref", "llama sp ref"):
        run = replace(RUNS[label], tp=False)
        model = _build(run, None)
        out[label] = torch.stack([_loss(model, run, 0, m).detach() for m in range(MICRO)])
    return out


def test_checkpoint_chain_across_tp_shapes_is_lossless(results):
    chain = results[0]["chain"]
    paths = list(chain)
    first = chain[paths[0]]
    assert any(v.dim() == 2 for k, v in first.items() if k.startswith("model."))  # N-D
    flat = chain[paths[2]]  # saved without TP: every parameter flattened
    assert all(v.dim() == 1 for k, v in flat.items() if k.startswith("model."))
    for path in paths[1:]:
        other = chain[path]
        assert sorted(other) == sorted(first), path
        for key, value in first.items():
            got = other[key]
            if got.shape != value.shape:
                got = got.view(value.shape)
            assert torch.equal(got, value), (path, key)


@pytest.mark.parametrize("label", ["dp2xtp2", "dp2xtp1", "dp1xtp4", "dp2 no TP"])
def test_resume_across_tp_shapes(results, label):
    for res in results:
        full, resumed = res["resume"]["uninterrupted"], res["resume"][label]
        exact = label == "dp2xtp2"
        for a, b in zip(resumed["losses"], full["losses"][SAVE_AT:], strict=True):
            if exact:
                assert torch.equal(a, b), (label, a, b)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=TOL_TP_SIZE)
        for name, value in full["params"].items():
            if exact:
                assert torch.equal(resumed["params"][name], value), (label, name)
            else:
                torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=TOL_TP_SIZE)


# ----------------------------------------------------------------------------- errors
def _errors() -> dict[str, str]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}

    def tp_model() -> nn.Module:
        return parallelize_gpt(build_model(GPT), mesh["tp"])

    out["world mesh"] = error_of(lambda: fully_shard(tp_model().layers[0]))
    out["tp mesh"] = error_of(lambda: fully_shard(tp_model().layers[0], mesh=mesh["tp"]))
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    out["3-D mesh"] = error_of(lambda: fully_shard(tp_model().layers[0], mesh=cube))

    def two_dim() -> None:
        layer = build_model(GPT).layers[0]
        w = layer.mlp.fc1.weight
        layer.mlp.fc1.weight = nn.Parameter(distribute_tensor(w, mesh, [Shard(0), Replicate()]))
        fully_shard(layer, mesh=mesh["dp"])

    out["2-D DTensor"] = error_of(two_dim)
    odd = replace(GPT, num_attention_heads=2)
    four = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    out["heads"] = error_of(lambda: parallelize_gpt(build_model(odd), four["tp"]))
    if hf_family_available("qwen3"):
        qwen3 = hf_decoder("qwen3", **LLAMA)
        out["qwen3"] = error_of(lambda: parallelize_hf_decoder(qwen3, mesh["tp"]))
    return out


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("world mesh", ["tensor-parallel over ranks", "mesh=mesh['dp']"]),
        ("tp mesh", ["share ranks", "two dimensions of one mesh"]),
        ("3-D mesh", ["3-D mesh", "mesh['dp']", "(replicate, shard, tp)"]),
        ("2-D DTensor", ["mlp.fc1.weight", "2-D mesh", "1-D tensor-parallel"]),
        ("heads", ["num_attention_heads", "pick a TP size"]),
        ("qwen3", ["q_norm", "Llama-style plan"]),
    ],
)
def test_errors_name_the_fix(results, case, words):
    for res in results:
        if case not in res["errors"]:
            pytest.skip(f"{case}: family not installed")
        message = res["errors"][case]
        for word in words:
            assert word in message, (case, message)


def test_flat_boxes_and_runs_cover_a_range_once():
    """The checkpoint decomposition (tensor_parallel.flat_boxes / box_runs) on every range
    of a 3-D tensor: boxes in order, contiguous, their runs the range's elements."""
    from graph_fsdp.fsdp.tensor_parallel import box_runs, flat_boxes

    shape = (3, 4, 5)
    index = torch.arange(60).view(shape)
    for start in range(0, 60, 7):
        for stop in range(start, 61, 11):
            got, pos = [], start
            for first, offs, sizes in flat_boxes(shape, start, stop):
                assert first == pos
                box = index[tuple(slice(o, o + z) for o, z in zip(offs, sizes))]
                assert len(flat_boxes(shape, start, stop)) <= 2 * len(shape) - 1
                runs = box_runs(shape, offs, sizes)
                flat_runs = torch.cat([torch.arange(s, s + n) for s, n in runs])
                assert torch.equal(flat_runs, box.reshape(-1))
                got.append(box.reshape(-1))
                pos += box.numel()
            whole = torch.cat(got) if got else torch.empty(0, dtype=torch.int64)
            assert torch.equal(whole, torch.arange(start, stop)), (start, stop)


@pytest.mark.parametrize(("dim", "stride", "size"), [(0, 2, 2), (0, 2, 4), (1, 3, 2), (0, 1, 2)])
def test_strided_pieces_are_megatrons_blocks(dim, stride, size):
    """A strided TP piece (Megatron's gated fc1: partition_stride=2) against Megatron's own
    split (``_initialize_affine_weight_cpu``: ``size * stride`` blocks, rank r holds blocks
    r, r + size, ...): ``local_of`` cuts those blocks out of the global tensor, and
    ``global_boxes`` maps every flat range of the local tensor to global boxes holding the
    same elements, in order and contiguous."""
    from graph_fsdp.fsdp.tensor_parallel import TPSpec

    shape = [6, 4]
    shape[dim] = 2 * size * stride
    full = torch.arange(math.prod(shape)).view(shape)
    blocks = torch.split(full, shape[dim] // (size * stride), dim=dim)
    for rank in range(size):
        local_shape = list(shape)
        local_shape[dim] //= size
        offsets = [0, 0]
        offsets[dim] = rank * local_shape[dim] // stride
        spec = TPSpec(
            None,
            size,
            rank,
            dim,
            torch.Size(shape),
            tuple(offsets),
            torch.Size(local_shape),
            partition_stride=stride,
        )
        local = torch.cat(blocks[rank::size], dim=dim)
        assert torch.equal(spec.local_of(full), local), rank
        n = local.numel()
        for start in range(0, n, 5):
            for stop in range(start, n + 1, 7):
                got, pos = [], start
                for first, offs, sizes in spec.global_boxes(start, stop):
                    assert first == pos, (rank, start, stop)
                    box = full[tuple(slice(o, o + z) for o, z in zip(offs, sizes))].reshape(-1)
                    assert torch.equal(box, local.reshape(-1)[first : first + box.numel()])
                    got.append(box)
                    pos += box.numel()
                assert pos == stop, (rank, start, stop)


def _dtensor_addresses(rank: int, world: int) -> dict:
    from types import SimpleNamespace

    from graph_fsdp.capture.torch_backend import CallSignature, _Replay
    from graph_fsdp.fsdp.tensor_parallel import data_address

    mesh = init_device_mesh("cpu", (world,))
    a, b = (DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)]) for _ in range(2))
    sig = CallSignature((a,), {})
    # The replay's input copy, driven for real with a graph whose replay reads the static
    # input (what a CUDA graph's kernels would read): a new DTensor input must reach it.
    static = DTensor.from_local(torch.zeros(4, 3), mesh, [Shard(0)])
    seen = []
    graph = SimpleNamespace(replay=lambda: seen.append(static.to_local().clone()))
    cap = SimpleNamespace(
        static_inputs=[static], fwd_graph=graph, static_outputs=[torch.zeros(1)], out_nondiff=()
    )
    _Replay.apply(cap, a)
    return {
        "address": (data_address(a), data_address(b)),
        "local": (a.to_local().data_ptr(), b.to_local().data_ptr()),
        "plain": data_address(a.to_local()) == a.to_local().data_ptr(),
        "recorded": sig.sample_ptrs[0] == a.to_local().data_ptr(),
        "replayed_on_new_input": torch.equal(seen[0], a.to_local()),
    }


def test_graphed_inputs_of_dtensors_are_told_apart_by_their_local_bytes():
    """A graph replay copies a new input into its static one unless both are one buffer. For
    DTensors ``data_ptr()`` is 0 (every DTensor "was" the static input: a module fed a
    sequence-parallel norm's DTensor output replayed on the captured input), so the capture
    code compares ``tensor_parallel.data_address``: the local tensor's bytes."""
    res = spawn(_dtensor_addresses, 1)[0]
    assert res["address"] == res["local"] and res["address"][0] != res["address"][1]
    assert res["plain"] and res["recorded"] and res["replayed_on_new_input"]
