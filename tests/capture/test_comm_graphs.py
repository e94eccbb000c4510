"""Communication graphs (comm_graphs.py [Note: communication graphs]) on real gloo groups.

CUDA graphs do not exist on CPU, so ``CommGraphs._capture`` is replaced by ``_KernelGraph``,
which does on CPU what a CUDA graph does: capturing records the dispatcher ops the function
issues (aten kernels, c10d collectives) without their effects, and a replay re-issues
exactly those ops on the recorded tensors - it never calls the function again, so Python
work inside it would be lost and a key that maps to other buffers would update stale ones.
What is tested is ours: which calls go through a graph, the keys (a moved buffer is a new
capture, a group whose buffers keep moving stops being captured), that the Python side
effects happen outside the captured function, and that training with every gather and
reduction replayed stays bit-identical to eager. Real CUDA graphs of the same calls replay
in tests/capture/test_comm_graphs_gpu.py (and inside every layerwise run on 2 GPUs).
"""

from __future__ import annotations

import pytest
import torch
from graph_fsdp_testing import shard_layers, spawn_cases
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from graph_fsdp import BufferPolicy, MixedPrecisionPolicy
from graph_fsdp.capture.comm_graphs import MAX_CAPTURES, CommGraphs
from graph_fsdp.models import GPTConfig, build_model, synthetic_batch

TINY = GPTConfig(vocab_size=128, num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=16)

COLLECTIVES = {
    torch.ops.c10d._allgather_base_.default,
    torch.ops.c10d._reduce_scatter_base_.default,
}
"""The collectives a gather or reduction issues; their first argument is the output."""


class _Recording(TorchDispatchMode):
    """Records the ops of a capture into ``ops`` as ``(op, args, kwargs, outputs)``.

    Views run (no effect but aliasing); ops that write an argument do not run (a capture
    records kernels, none runs) and return what they would - a collective its output and a
    completed ``Work``; out-of-place ops run once to make their output tensor, which a replay
    rewrites in place (the graph's pool). A value read on the host (``.item()``) is an
    error, as under a real capture.
    """

    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view:
            return func(*args, **kwargs)
        if func.namespace == "c10d":
            if func not in COLLECTIVES:
                raise AssertionError(f"{func}: not a collective this test knows how to record")
            self.ops.append((func, args, kwargs, None))
            done = torch.futures.Future()
            done.set_result([args[0]])
            return args[0], torch._C._distributed_c10d._create_work_from_future(done).boxed()
        written = [
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        if written:
            self.ops.append((func, args, kwargs, None))
            i, name = written[0]
            return args[i] if i < len(args) else kwargs[name]
        result = func(*args, **kwargs)
        outputs = tree_flatten(result)[0]
        if any(not isinstance(x, torch.Tensor | None) for x in outputs):
            raise RuntimeError(f"{func} reads a value on the host: not capturable")
        self.ops.append((func, args, kwargs, outputs))
        return result


class _KernelGraph:
    """A CPU stand-in for a CUDA graph of ``fn`` (see the module docstring)."""

    def __init__(self, fn) -> None:
        self.fn = fn  # for the key check in _sound_keys only: never called again
        self.ops: list = []
        self.replays = 0
        with _Recording(self.ops):
            fn()

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, outputs in self.ops:
            result = func(*args, **kwargs)
            if func in COLLECTIVES:
                result[1].wait()
            elif outputs is not None:
                for kept, new in zip(outputs, tree_flatten(result)[0], strict=True):
                    if kept is not None:
                        kept.copy_(new)

    def reset(self) -> None:
        self.ops = []


def _kernel_graph(self, fn):
    return _KernelGraph(fn)


def test_a_kernel_graph_replays_kernels_not_python() -> None:
    """The stand-in is honest: a replay repeats the recorded tensor work, on the tensors it
    was recorded with, and none of the function's Python."""
    calls = []
    acc, x = torch.zeros(3), torch.ones(3)

    def fn():
        calls.append(1)  # Python: runs at capture only
        tmp = x * 2  # an out-of-place kernel: its output is rewritten at every replay
        acc.add_(tmp)

    graph = _KernelGraph(fn)
    assert calls == [1] and torch.equal(acc, torch.zeros(3))  # captured, nothing ran
    graph.replay()
    graph.replay()
    x.fill_(10.0)  # a replay reads the recorded tensors' current values
    graph.replay()
    assert calls == [1] and torch.equal(acc, torch.full((3,), 24.0))
    with pytest.raises(RuntimeError, match="reads a value on the host"):
        _KernelGraph(lambda: x.sum().item())


def _sound_keys(run):
    """``CommGraphs.run`` checking that a key found again comes with the same kernels: the
    same function over the same tensor objects and flags (else a replay would run another
    variant or other buffers than the eager path would)."""

    def checked(self, key, owner, fn):
        graph = self.graphs.get(key)
        if graph is not None:
            was = graph.fn
            assert was.func == fn.func and was.keywords == fn.keywords, key
            assert all(a is b for a, b in zip(was.args, fn.args, strict=True)), key
        return run(self, key, owner, fn)

    return checked


def _train(rank: int, world: int, graphs: bool, pin: bool, mixed: bool, comm=None):
    """Six steps; ``mixed``: one or two microbatches (no_sync accumulation) and gradients
    kept or set to None by the optimizer, changing from step to step."""
    if not graphs:
        return _train_steps(rank, False, pin, mixed, comm)
    capture, run = CommGraphs._capture, CommGraphs.run
    CommGraphs._capture = _kernel_graph
    CommGraphs.run = _sound_keys(run)
    try:
        return _train_steps(rank, True, pin, mixed, comm)
    finally:
        CommGraphs._capture, CommGraphs.run = capture, run


def _train_steps(rank: int, graphs: bool, pin: bool, mixed: bool, comm) -> dict:
    torch.manual_seed(0)
    model = build_model(TINY, device="cpu")
    # fp32 reduction by default (a cast kernel before it); ``comm`` bf16: the gradients as
    # they are, the main gradients updated from a separate output (more keys share buffers).
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, grad_comm_dtype=comm)
    buffers = BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True)
    shard_layers(model, mp_policy=mp, buffer_policy=buffers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm_graphs = CommGraphs(pool=None)
    losses, keys_per_step = [], []
    for step in range(6):
        micro = 1 + step % 2 if mixed else 1
        root = model._fsdp_state.root
        if graphs and step == 1:  # after an eager step, as a layerwise runner lends them
            root.capture.lend_comm_graphs(comm_graphs)
            # Every buffer in place (what the GPU's caching allocator gives a steady loop;
            # CPU allocations move): keys repeat, replays must match them.
            if pin:
                root.allocator.pin_roles(("param", "grad", "grad_comm", "rs_out"))
            for state in root.states:
                for group in state.groups:
                    (group.pin_main_grad if pin else group.ensure_main_grad)()
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            x, y = synthetic_batch(
                TINY, micro_batch_size=2, step=10 * step + m + rank, device="cpu"
            )
            loss = model(x, y) / micro
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=not mixed or step % 3 == 0)
        keys_per_step.append(len(comm_graphs.graphs))
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "report": comm_graphs.report(),
        "graph_replays": sum(g.replays for g in comm_graphs.graphs.values()),
        "captures": dict(comm_graphs.captures),
        "keys_per_step": keys_per_step,
        "groups": sum(len(s.groups) for s in model._fsdp_state.root.states),
    }


PINNED = {
    "plain": (False, None),
    "no_sync+accumulate": (True, None),
    "no_sync+accumulate, bf16 reduction": (True, torch.bfloat16),
}


@pytest.fixture(scope="module")
def two_ranks():
    """Every training of this file, eager and replayed, in one spawned group."""
    cases = {}
    for label, (mixed, comm) in PINNED.items():
        cases[f"eager:{label}"] = (_train, False, True, mixed, comm)
        cases[f"replayed:{label}"] = (_train, True, True, mixed, comm)
    cases["eager:moving"] = (_train, False, False, False)
    cases["replayed:moving"] = (_train, True, False, False)
    return spawn_cases(cases, 2)


@pytest.mark.parametrize("label", list(PINNED))
def test_replayed_gathers_and_reductions_train_bit_identically(two_ranks, label) -> None:
    eager, replayed = two_ranks[f"eager:{label}"], two_ranks[f"replayed:{label}"]
    for e, r in zip(eager, replayed):
        assert e["losses"] == r["losses"]
        assert all(torch.equal(a, b) for a, b in zip(e["params"], r["params"]))
        rep = r["report"]
        assert rep["failed"] is None and rep["replays"] > 0, rep
        assert r["graph_replays"] == rep["replays"]  # every replay went through a graph
        # Every group's gathers and reductions went through graphs; the pinned slots keep
        # the gather keys, so only reductions whose buffers moved were captured again.
        owners = {kind for _, kind in r["captures"]}
        assert owners == {"gather", "reduce"}, r["captures"]
        assert all(n <= MAX_CAPTURES for n in r["captures"].values())
        gathers = [n for (_, kind), n in r["captures"].items() if kind == "gather"]
        assert len(gathers) == r["groups"] and set(gathers) == {1}, r["captures"]


def test_buffers_that_keep_moving_stop_being_captured(two_ranks) -> None:
    # Without pinned slots the weight slots are re-made after every forward (new bytes, new
    # addresses): each new address is a capture, up to MAX_CAPTURES a group, then eager.
    eager, replayed = two_ranks["eager:moving"], two_ranks["replayed:moving"]
    for e, r in zip(eager, replayed):
        assert e["losses"] == r["losses"]
        assert all(torch.equal(a, b) for a, b in zip(e["params"], r["params"]))
        assert all(n <= MAX_CAPTURES for n in r["captures"].values())
        assert r["report"]["replays"] + r["report"]["eager_calls"] > 0


def test_a_failed_capture_leaves_every_call_eager() -> None:
    calls = []

    def failing_capture(self, fn):
        self.failed = "RuntimeError: no graphs here"
        return None

    CommGraphs._capture, original = failing_capture, CommGraphs._capture
    try:
        graphs = CommGraphs(pool=None)
        graphs.run(("k",), ("owner", "gather"), lambda: calls.append(1))
        graphs.run(("k",), ("owner", "gather"), lambda: calls.append(2))
    finally:
        CommGraphs._capture = original
    assert calls == [1, 2] and graphs.report()["eager_calls"] == 2 and not graphs.graphs
