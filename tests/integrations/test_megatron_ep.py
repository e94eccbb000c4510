"""Expert parallelism for Megatron-Core GPTs: the logic that needs no megatron-core (CI).

Config and scope rules at expert_model_parallel_size > 1, the EP size check, the expert
layouts shard_gpt marks, and the per-global-expert weight draws of build_gpt - on module
trees with Megatron's attribute names (SequentialMLP's ``local_experts.<i>``, TE
GroupedLinear's ``weight<i>``, graph_fsdp's stacked experts), the draws across real gloo EP
groups. The Megatron-Core model itself: test_megatron_ep_gloo.py (needs megatron-core) and
tests/integrations/test_megatron_ep_gpu.py.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from graph_fsdp.capture.scopes import GraphConfigError
from graph_fsdp.fsdp.experts import ExpertLayout
from graph_fsdp.integrations import megatron as gm
from graph_fsdp.integrations.megatron import ep as mep
from graph_fsdp.training.processes import spawn

# ------------------------------------------------------------------ sizes and config


@pytest.mark.parametrize(("ep", "world"), [(1, 1), (2, 4), (4, 4), (8, 16)])
def test_ep_sizes_that_divide_the_world(ep: int, world: int) -> None:
    assert mep.check_expert_parallel_size(ep, world) == ep


@pytest.mark.parametrize(
    ("ep", "world", "expected"),
    [
        (3, 4, "expert_model_parallel_size=3 does not divide the world size 4"),
        (4, 6, "use one of [1, 2, 3, 6] or launch a multiple of 4 ranks"),
        (0, 4, "must be a positive integer"),
        (2.0, 4, "must be a positive integer"),
        (True, 4, "must be a positive integer"),
    ],
)
def test_ep_sizes_refused_with_the_fix(ep, world: int, expected: str) -> None:
    with pytest.raises(ValueError) as err:
        mep.check_expert_parallel_size(ep, world)
    assert expected in str(err.value)


MOE = gm.MCoreGPTConfig(num_experts=4, moe_shared_expert_intermediate_size=64)
DROP_PAD = dataclasses.replace(
    MOE, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
)


@pytest.mark.parametrize("ep", [2, 4])
def test_config_takes_expert_parallel_sizes_that_divide_the_experts(ep: int) -> None:
    assert dataclasses.replace(MOE, expert_model_parallel_size=ep).expert_model_parallel_size == ep
    assert dataclasses.replace(DROP_PAD, expert_model_parallel_size=ep).is_moe


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("scopes", [[], ["moe"], ["attn", "moe"], ["full_iteration"]])
def test_drop_padding_captures_whole_at_any_ep(ep: int, scopes: list[str]) -> None:
    cfg = dataclasses.replace(DROP_PAD, expert_model_parallel_size=ep)
    assert gm.check_mcore_scopes(cfg, scopes) == scopes


@pytest.mark.parametrize(
    "scopes", [["attn"], ["attn", "moe_router"], ["moe_router", "moe_preprocess"]]
)
def test_dropless_ep_captures_the_parts_before_the_dispatch(scopes: list[str]) -> None:
    cfg = dataclasses.replace(MOE, expert_model_parallel_size=2)
    assert gm.check_mcore_scopes(cfg, scopes) == scopes


@pytest.mark.parametrize("scopes", [[], ["moe"], ["full_iteration"]])
def test_dropless_ep_refusal_names_the_sync_and_drop_padding(scopes: list[str]) -> None:
    cfg = dataclasses.replace(MOE, expert_model_parallel_size=2)
    with pytest.raises(GraphConfigError) as err:
        gm.check_mcore_scopes(cfg, scopes)
    text = str(err.value)
    for part in (
        "expert_model_parallel_size=2",
        "split sizes to the host",
        "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        "moe_expert_capacity_factor=1.0 and moe_pad_expert_input_to_capacity=True",
        "--cuda-graph-scope attn moe_router",
        "moe_experts_impl='grouped_mm'",
    ):
        assert part in text, (part, text)


@pytest.mark.parametrize("scopes", [[], ["moe"], ["full_iteration"], ["attn", "moe_router"]])
def test_grouped_mm_at_ep_captures_whole(scopes: list[str]) -> None:
    """The grouped_mm experts' dropless exchange has static shapes at EP > 1."""
    cfg = gm.MCoreGPTConfig(
        num_experts=4,
        moe_experts_impl="grouped_mm",
        expert_model_parallel_size=2,
        moe_receive_buffer_factor=1.5,
    )
    assert gm.check_mcore_scopes(cfg, scopes) == scopes


# ------------------------------------------------------------------ expert layouts


class Router(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4, bias=False)


class Expert(nn.Module):
    def __init__(self, hidden: int = 4, ffn: int = 6) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False)


class SequentialExperts(nn.Module):
    """Megatron's SequentialMLP: ``local_experts.<i>.linear_fc1.weight``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(Expert() for _ in range(n))


class TEGroupedLinear(nn.Module):
    """TE's GroupedLinear: ``weight<i>`` and ``num_gemms``."""

    def __init__(self, n: int, out: int, inp: int) -> None:
        super().__init__()
        self.num_gemms = n
        for i in range(n):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out, inp)))


class TEGroupedExperts(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.linear_fc1, self.linear_fc2 = TEGroupedLinear(n, 6, 4), TEGroupedLinear(n, 4, 6)


class StackedLinear(nn.Module):
    def __init__(self, n: int, out: int, inp: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out, inp))


class StackedExperts(nn.Module):
    """graph_fsdp's GroupedMMExperts: ``linear_fc1.weight[e]``."""

    graph_fsdp_stacked_experts = True

    def __init__(self, n: int) -> None:
        super().__init__()
        self.linear_fc1, self.linear_fc2 = StackedLinear(n, 6, 4), StackedLinear(n, 4, 6)


class MoE(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.router, self.experts = Router(), experts


class Layer(nn.Module):
    def __init__(self, experts: nn.Module | None) -> None:
        super().__init__()
        self.self_attention = nn.Linear(4, 4)
        self.mlp = MoE(experts) if experts is not None else Expert()


KINDS = {"sequential": SequentialExperts, "te": TEGroupedExperts, "stacked": StackedExperts}


def test_layouts_of_the_three_expert_modules() -> None:
    seq = mep.expert_layouts(Layer(SequentialExperts(2)))
    assert seq["mlp.experts.local_experts.1.linear_fc2.weight"] == ExpertLayout(
        "{}.linear_fc2.weight", 1, 2
    )
    te = mep.expert_layouts(Layer(TEGroupedExperts(3)))
    assert te["mlp.experts.linear_fc1.weight2"] == ExpertLayout("weight{}", 2, 3)
    stacked = mep.expert_layouts(Layer(StackedExperts(2)))
    assert stacked == {
        "mlp.experts.linear_fc1.weight": ExpertLayout(),
        "mlp.experts.linear_fc2.weight": ExpertLayout(),
    }
    # Global names at EP rank 1 of 2: expert 1 + 1 * 2 = 3.
    layout = seq["mlp.experts.local_experts.1.linear_fc2.weight"]
    name, _, _ = layout.global_entry(
        "m.mlp.experts.local_experts.1.linear_fc2.weight", torch.Size((4, 6)), 1, 2
    )
    assert name == "m.mlp.experts.local_experts.3.linear_fc2.weight"


def test_an_unknown_expert_layout_is_refused_before_sharding() -> None:
    class Fused(nn.Module):  # one parameter for every expert, not stacked by our marker
        def __init__(self) -> None:
            super().__init__()
            self.weight1 = nn.Parameter(torch.empty(4, 12))

    with pytest.raises(ValueError) as err:
        mep.expert_layouts(Layer(Fused()))
    text = str(err.value)
    assert "mlp.experts.weight1" in text and "mark_expert_params" in text


def test_expert_groups_off_at_ep_above_one_is_refused() -> None:
    layers = [Layer(SequentialExperts(2))]
    with pytest.raises(ValueError, match="expert_groups=False.*would be summed"):
        mep.expert_mesh_for(layers, 2, False, "cpu")
    # EP = 1, default: the experts stay in the dense groups, unmarked.
    assert mep.expert_mesh_for(layers, 1, None, "cpu") is None
    assert not any(hasattr(p, "_graph_fsdp_expert") for p in layers[0].parameters())
    assert mep.moe_layers([Layer(None), *layers]) == layers


# ------------------------------------------------------------------ the same global experts


def _builder(kind: str):
    cls = KINDS[kind]

    def build(num_local_experts, config, pg_collection=None, name=None):
        module = cls(num_local_experts)
        for p in module.parameters():
            nn.init.uniform_(p)  # draws from the global RNG, as Megatron's CPU init does
        return module

    return build


def _global_experts(experts: nn.Module) -> list[tuple[int, str, torch.Tensor]]:
    return [(i, fc, w.detach().clone()) for i, fc, w in mep.expert_weights(experts)]


def _draws(rank: int, world: int) -> dict:
    config = SimpleNamespace(
        perform_initialization=True,
        init_method=functools.partial(nn.init.normal_, std=0.02),
        output_layer_init_method=functools.partial(nn.init.normal_, std=0.01),
    )
    solo = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    pair = dist.new_group(list(range(world)))
    out: dict = {}
    for kind in KINDS:
        for ep, group in ((1, solo[rank]), (2, pair)):
            n = 4 // ep
            init = mep.GlobalExpertInit(_builder(kind), seed=7, layers=itertools.count())
            torch.manual_seed(0)
            layers = [init(n, config, SimpleNamespace(ep=group)) for _ in range(2)]
            after = torch.rand(1)  # the global stream once both layers are built
            mine = {
                (layer, dist.get_rank(group) * n + i, fc): w
                for layer, experts in enumerate(layers)
                for i, fc, w in _global_experts(experts)
            }
            every: list = [None] * world
            dist.all_gather_object(every, mine)
            merged = {k: v for part in every for k, v in part.items()}
            out[(kind, ep)] = (merged, after)
    return out if rank == 0 else {}


def test_expert_weights_are_drawn_per_global_expert() -> None:
    """EP = 2 over 2 gloo ranks (2 experts each) and EP = 1 (4 experts each): the same
    global expert weights, and the global RNG stream left as if no expert had been built."""
    out = spawn(_draws, 2)[0]
    torch.manual_seed(0)
    untouched = torch.rand(1)
    for kind in KINDS:
        ep1, after1 = out[(kind, 1)]
        ep2, after2 = out[(kind, 2)]
        assert torch.equal(after1, untouched) and torch.equal(after2, untouched), kind
        assert sorted(ep1) == sorted(ep2) and len(ep1) == 2 * 4 * 2, kind
        for key, w in ep1.items():
            assert torch.equal(ep2[key], w), (kind, key)
        # Distinct experts, layers and matrices get distinct draws, at init_method's scale.
        fc1 = [ep1[(layer, e, "linear_fc1")] for layer in range(2) for e in range(4)]
        assert all(not torch.equal(a, b) for a, b in itertools.combinations(fc1, 2)), kind
        assert 0.01 < torch.stack(fc1).std().item() < 0.03, kind
