"""Packed documents for Megatron-Core GPTs on CPU (integrations/megatron/packed.py): the THD
``PackedSeqParams`` a PackedBatch makes, its flattening into graph inputs, and the refusals -
the local layer spec, TP, Megatron's schedule, the command line. The training runs are on
GPUs: tests/integrations/test_megatron_packed_gpu.py."""

from __future__ import annotations

import pytest
import torch
from graph_fsdp_testing import TINY_MCORE_SHAPE, cli_error
from torch.utils._pytree import tree_flatten, tree_unflatten

from graph_fsdp.capture.torch_backend import CallSignature
from graph_fsdp.training.packing import PackingPolicy, pack_tensors
from graph_fsdp.training.processes import spawn

try:
    from graph_fsdp.integrations import megatron as gm

    gm.require_megatron()
except ImportError as err:  # megatron-core does not import here
    pytest.skip(f"megatron-core does not import ({err})", allow_module_level=True)

T, D = 16, 3
POLICY = PackingPolicy(budget=T, max_documents=D)


def _docs(*lengths: int) -> list[torch.Tensor]:
    return [torch.arange(1, n + 1) for n in lengths]


def _packs() -> list:
    """Packs of 2 rows whose document counts and lengths differ from pack to pack."""
    return [
        pack_tensors([_docs(5, 4), _docs(16)], POLICY),
        pack_tensors([_docs(3, 3, 3), _docs(2)], POLICY),
        pack_tensors([_docs(15), _docs(7, 1, 8)], POLICY),
    ]


def test_packed_seq_params_of_a_pack_are_its_offsets_as_they_are() -> None:
    pack = _packs()[0]
    params = gm.packed_seq_params(pack.cu_seqlens, T)
    assert params.qkv_format == "thd"
    # The same tensor for queries and keys, no copy: a graph's static input is read in place.
    assert params.cu_seqlens_q is pack.cu_seqlens and params.cu_seqlens_kv is pack.cu_seqlens
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == T  # the budget, a host int
    assert isinstance(params.max_seqlen_q, int)
    # Row 0: documents of 5 and 4, a zero-length slot, the tail (9..16); row 1: one document of
    # 16, two zero-length slots and a zero-length tail; then b * T.
    assert pack.cu_seqlens.tolist() == [0, 5, 9, 9, 16, 32, 32, 32, 32]
    # Nothing that would sync with the host in Megatron or TE: no padded offsets (TE infers
    # pad_between_seqs=False without reading them), no total_tokens (its __post_init__ would
    # repeat_interleave on the device sizes).
    assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
    assert getattr(params, "total_tokens", None) is None


def test_offsets_copied_into_static_tensors_keep_one_address() -> None:
    packs = _packs()
    static = torch.empty_like(packs[0].cu_seqlens)
    addresses = set()
    for pack in packs:
        static.copy_(pack.cu_seqlens)  # what a graph replay does with its static input
        params = gm.packed_seq_params(static, T)
        addresses.add(params.cu_seqlens_q.data_ptr())
        assert torch.equal(params.cu_seqlens_q, pack.cu_seqlens)
    assert addresses == {static.data_ptr()}


def test_offsets_of_another_dtype_are_refused() -> None:
    with pytest.raises(ValueError, match="1-D int32"):
        gm.packed_seq_params(_packs()[0].cu_seqlens.long(), T)


def test_packed_seq_params_flatten_to_graph_inputs() -> None:
    """A captured layer's call with ``packed_seq_params``: its offsets are the call's tensors
    (copied into the graph's static inputs at every replay), its other fields constants."""
    first, second = _packs()[:2]
    call = lambda pack, s=T: ((), {"packed_seq_params": gm.packed_seq_params(pack.cu_seqlens, s)})  # noqa: E731
    args, kwargs = call(first)
    flat, spec = tree_flatten((args, kwargs))
    assert len(flat) == 2 and all(t is first.cu_seqlens for t in flat)
    signature = CallSignature(args, kwargs, what="a layer")  # no "object holding tensors"
    tensors = signature.tensors_of(*call(second))
    assert tensors is not None and all(t is second.cu_seqlens for t in tensors)
    assert signature.tensors_of(*call(second, 2 * T)) is None  # another budget: eager
    rebuilt = tree_unflatten([t.clone() for t in flat], spec)[1]["packed_seq_params"]
    assert type(rebuilt) is type(kwargs["packed_seq_params"])
    assert rebuilt.qkv_format == "thd" and rebuilt.max_seqlen_kv == T
    assert torch.equal(rebuilt.cu_seqlens_kv, first.cu_seqlens)


def test_packed_model_config_turns_on_te_rope_fusion() -> None:
    cfg = gm.MCoreGPTConfig(**TINY_MCORE_SHAPE)
    assert gm.packed_model_config(cfg).apply_rope_fusion  # unfused THD RoPE reads the host
    learned = gm.MCoreGPTConfig(**TINY_MCORE_SHAPE, position_embedding_type="learned_absolute")
    assert gm.packed_model_config(learned) == learned  # positions come from position_ids


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(transformer_impl="local"), "--transformer-impl transformer_engine"),
    ],
)
def test_packed_model_config_refusals(kwargs: dict, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        gm.packed_model_config(gm.MCoreGPTConfig(**TINY_MCORE_SHAPE, **kwargs))


def test_packed_model_config_accepts_tensor_parallelism() -> None:
    """TP > 1 packs (the loss through Megatron's vocabulary-parallel cross entropy:
    megatron/packed.py ``token_loss_sum``), with sequence parallelism too."""
    for sp in (False, True):
        cfg = gm.MCoreGPTConfig(
            **TINY_MCORE_SHAPE, tensor_model_parallel_size=2, sequence_parallel=sp
        )
        assert gm.packed_model_config(cfg).tensor_model_parallel_size == 2


def test_train_config_refusals() -> None:
    from graph_fsdp.integrations.megatron.train import MCoreTrainConfig

    model = gm.MCoreGPTConfig(**TINY_MCORE_SHAPE)
    packing = PackingPolicy(budget=model.seq_length, max_documents=D)
    MCoreTrainConfig(model=model, packing=packing)  # the TE spec: accepted
    with pytest.raises(ValueError, match="budget=8 != MCoreGPTConfig.seq_length"):
        MCoreTrainConfig(model=model, packing=PackingPolicy(budget=8))
    with pytest.raises(ValueError, match="DotProductAttention refuses packed sequences"):
        local = gm.MCoreGPTConfig(**TINY_MCORE_SHAPE, transformer_impl="local")
        MCoreTrainConfig(model=local, packing=packing)
    with pytest.raises(ValueError, match="use_megatron_schedule"):
        MCoreTrainConfig(model=model, packing=packing, use_megatron_schedule=True)


def _local_spec_pack(rank: int, world: int) -> str:
    gm.init_parallel_state()
    lm = gm.build_gpt(gm.MCoreGPTConfig(**TINY_MCORE_SHAPE, transformer_impl="local"), "cpu")
    s = TINY_MCORE_SHAPE["seq_length"]
    pack = pack_tensors([_docs(3, 4)], PackingPolicy(budget=s, max_documents=2))
    try:
        lm(pack.input_ids, pack.labels, position_ids=pack.position_ids, cu_seqlens=pack.cu_seqlens)
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_local_spec_model_refuses_a_pack_naming_the_te_spec() -> None:
    err = spawn(_local_spec_pack, 1, timeout=300)[0]
    assert "local DotProductAttention" in err and "--transformer-impl transformer_engine" in err


# ------------------------------------------------------------------ command line
MCORE = ["train", "--model", "mcore-gpt", "--device", "cpu", "--nproc", "2", "--packed-sequences"]
SHAPE = ["--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2"]


def test_cli_refuses_the_local_spec_naming_the_te_flag(capsys) -> None:
    err = cli_error(capsys, *MCORE, *SHAPE, "--transformer-impl", "local")
    assert (
        "--packed-sequences with --model mcore-gpt needs --transformer-impl transformer_engine"
        in err
    )


def test_cli_refuses_megatron_schedule_with_packs(capsys) -> None:
    err = cli_error(
        capsys, *MCORE, *SHAPE, "--transformer-impl", "transformer_engine",
        "--use-megatron-schedule",
    )  # fmt: skip
    assert "drop --use-megatron-schedule" in err


def test_cli_accepts_packing_with_the_te_spec(capsys) -> None:
    """Every packing check passes; the run then stops at the environment (TE needs CUDA)."""
    from graph_fsdp.cli import mcore as megatron_cli
    from graph_fsdp.cli.launch import resolve_plan
    from graph_fsdp.cli.main import build_parser

    argv = [*MCORE, *SHAPE, "--transformer-impl", "transformer_engine"]
    argv += ["--packed-max-documents", "4"]
    args = build_parser().parse_args(argv)
    plan = resolve_plan("cpu", 2)
    model = megatron_cli.mcore_config(args, plan.world_size)
    cfg = megatron_cli.base_train_config(args, model, plan)
    assert cfg.packing == PackingPolicy(budget=16, max_documents=4, seed=args.seed)
    err = cli_error(capsys, *argv)
    assert "needs CUDA" in err and "packed" not in err


def test_sequence_parallel_pack_must_split_over_tp() -> None:
    """Sequence parallelism splits the pack's ``b * T`` tokens over the TP ranks: a pack of 3 x
    5 tokens at TP 2 is refused before the model runs, naming the fix."""
    from types import SimpleNamespace

    from graph_fsdp.integrations.megatron.packed import packed_loss

    gpt = torch.nn.Module()
    gpt.config = SimpleNamespace(
        tensor_model_parallel_size=2, sequence_parallel=True, apply_rope_fusion=True
    )
    pack = pack_tensors([[torch.arange(4)]] * 3, PackingPolicy(budget=5, max_documents=1), "cpu")
    with pytest.raises(ValueError, match=r"3 x 5 = 15 tokens .* multiple of 2"):
        packed_loss(gpt, pack.input_ids, pack.labels, pack.position_ids, pack.cu_seqlens)


@pytest.mark.parametrize(
    "experts",
    [
        ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
        ["--moe-experts-impl", "grouped_mm", "--expert-model-parallel-size", "2"],
    ],
    ids=["drop-padding", "grouped_mm-ep2"],
)
def test_cli_packs_mcore_moe_with_both_expert_kinds(capsys, monkeypatch, experts: list) -> None:
    """``--model mcore-moe --packed-sequences``: drop-padding with Megatron's experts and the
    grouped_mm experts at EP 2 make packed configs (EP's full_iteration turns NCCL's graph
    registration off); the run then stops at the environment only (TE and the alltoall
    dispatcher need CUDA)."""
    import os

    from graph_fsdp.cli import mcore as megatron_cli
    from graph_fsdp.cli.launch import resolve_plan
    from graph_fsdp.cli.main import build_parser

    argv = [*MCORE, *SHAPE, "--transformer-impl", "transformer_engine", *experts]
    argv[argv.index("mcore-gpt")] = "mcore-moe"
    argv += ["--num-experts", "8", "--cuda-graph-impl", "torch"]
    argv += ["--cuda-graph-scope", "full_iteration", "--fsdp-double-buffer"]
    argv += ["--fsdp-db-use-persist-buf-on-alloc-fail"]
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)  # the CLI sets it for EP
    args = build_parser().parse_args(argv)
    plan = resolve_plan("cpu", 2)
    model = megatron_cli.mcore_config(args, plan.world_size)
    cfg = megatron_cli.base_train_config(args, model, plan)
    assert cfg.packing is not None and cfg.model.num_experts == 8
    assert cfg.model.moe_experts_impl == ("grouped_mm" if "grouped_mm" in experts else "megatron")
    err = cli_error(capsys, *argv)
    assert "needs CUDA" in err and "packed" not in err, err
    ep = "grouped_mm" in experts
    assert os.environ.get("NCCL_GRAPH_REGISTER") == ("0" if ep else None)
