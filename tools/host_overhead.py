"""CPU harness: host time per layer of FSDP's eager work around layerwise graph replays.

Runs a tiny 16-layer GPT (compute negligible) under graph_fsdp in a 1-process gloo group,
captures whole-layer "graphs" with the real ``LayerwiseGraphs`` machinery, but with
``torch.cuda`` graph/stream/RNG calls replaced by no-op fakes (a fake graph's replay does
nothing: the static outputs of its capture are returned), so a timed step runs exactly the
Python that a GPU host runs between replays - FSDP hooks, dispatcher, replay Functions -
minus the CUDA API calls themselves (their counts per layer are printed with ``--cuda``).

    python tools/host_overhead.py [--steps 200] [--profile] [--cuda]
    torchrun --nproc-per-node 2 tools/host_overhead.py --real [--bf16] [--profile]

``--real`` runs the same tiny model on real GPUs over NCCL (no fakes; one process per GPU,
under torchrun): its step is host-bound, so the times are the GPU host's cost per layer of
FSDP's work, the collectives' launches and the graph replays, CUDA API calls included.

``--cuda`` additionally fakes a CUDA CommContext (streams, events, NVTX) with counting
stand-ins, to count the CUDA API calls FSDP issues per layer and direction. graph_fsdp's NVTX
ranges are off unless a profiler listens (cuda_streams.py ``nvtx_enabled``); ``--nvtx``
turns them on, as under nsys.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import time
from collections import Counter

import torch
import torch.distributed as dist

COUNTS: Counter = Counter()


class _FakeEvent:
    def __init__(self, *a, **k):
        COUNTS["Event()"] += 1

    def record(self, stream=None):
        COUNTS["event.record"] += 1


class _FakeStream:
    _ids = 0

    def __init__(self, *a, **k):
        _FakeStream._ids += 1
        self.stream_id, self.device_index, self.device_type = _FakeStream._ids, 0, 1

    def wait_stream(self, other):
        COUNTS["stream.wait_stream"] += 1

    def wait_event(self, event):
        COUNTS["stream.wait_event"] += 1

    def record_event(self, event=None):
        COUNTS["stream.record_event"] += 1
        return _FakeEvent()


_MAIN = _FakeStream()


def _current_stream(device=None):
    COUNTS["current_stream()"] += 1
    return _MAIN


@contextlib.contextmanager
def _stream_ctx(stream):
    COUNTS["torch.cuda.stream()"] += 1
    yield


class _FakeGraph:
    def replay(self):
        COUNTS["graph.replay"] += 1

    def reset(self):
        pass


@contextlib.contextmanager
def _graph_ctx(graph, pool=None, stream=None, capture_error_mode="global"):
    yield


def _nvtx_push(name):
    COUNTS["nvtx push"] += 1


def _nvtx_pop():
    pass


def install_fakes(cuda_comm: bool) -> None:
    tc = torch.cuda
    tc.CUDAGraph = _FakeGraph
    tc.graph = _graph_ctx
    tc.Stream = _FakeStream
    tc.Event = _FakeEvent
    tc.stream = _stream_ctx
    tc.current_stream = _current_stream
    tc.synchronize = lambda *a, **k: None
    tc.is_current_stream_capturing = lambda: False
    tc.graph_pool_handle = lambda: None
    tc.get_rng_state = lambda *a, **k: torch.get_rng_state()
    tc.set_rng_state = lambda *a, **k: None
    # graph_fsdp is imported after torch.cuda is faked (here and below)
    import graph_fsdp.capture.layerwise as layerwise  # noqa: PLC0415

    layerwise.check_capturable = lambda model, *a, **k: model._fsdp_state
    if cuda_comm:
        import graph_fsdp.buffers.allocator as alloc  # noqa: PLC0415
        import graph_fsdp.fsdp.comm as comm  # noqa: PLC0415

        orig_init = comm.CommContext.__init__

        def init(self, device, group, replicate_group=None, **kwargs):
            orig_init(self, device, group, replicate_group, **kwargs)
            self.cuda = True
            self.ag_stream, self.rs_stream = _FakeStream(), _FakeStream()

        comm.CommContext.__init__ = init
        # Slot.take only waits when tensor.is_cuda: count what it would do on CUDA.
        name = "acquire" if hasattr(alloc.Slot, "acquire") else "take"
        orig_take = getattr(alloc.Slot, name)

        def take(self, key, *a):
            if self.pending:
                COUNTS["stream.wait_event"] += len(self.pending)
                COUNTS["current_stream()"] += 1
            return orig_take(self, key, *a)

        setattr(alloc.Slot, name, take)
        tc.is_available = lambda: True
        tc.nvtx.range_push = _nvtx_push
        tc.nvtx.range_pop = _nvtx_pop
        with contextlib.suppress(AttributeError):
            tc.nvtx._nvtx_push = _nvtx_push


TIMES: Counter = Counter()


def _timed(cls, name: str, label: str) -> None:
    fn = getattr(cls, name)
    wrapped = fn.__func__ if isinstance(fn, staticmethod) else fn

    def timer(*a, **k):
        t0 = time.perf_counter()
        try:
            return wrapped(*a, **k)
        finally:
            TIMES[label] += time.perf_counter() - t0

    for attr in (
        "_capture_time_fn",
        "_cuda_graph_backward_handler",
        "_cuda_graph_backward_pre_handler",
    ):
        if hasattr(wrapped, attr):
            setattr(timer, attr, getattr(wrapped, attr))
    setattr(cls, name, staticmethod(timer) if isinstance(fn, staticmethod) else timer)


def install_timers() -> None:
    """Wrap the pieces that run per layer (before the model is built: hooks bind methods)."""
    from graph_fsdp.capture import torch_backend  # noqa: PLC0415
    from graph_fsdp.fsdp.state import FSDPState  # noqa: PLC0415

    for name, label in [
        ("pre_forward", "fwd: pre_forward (gather, prefetch)"),
        ("_register_post_backward_hook", "fwd: post-backward registration (+_PostBackward fwd)"),
        ("post_forward", "fwd: post_forward (reshard)"),
        ("_register_pre_backward_hook", "fwd: pre-backward registration"),
        ("pre_backward", "bwd: pre_backward"),
        ("post_backward", "bwd: post_backward (reduce, reshard)"),
    ]:
        _timed(FSDPState, name, label)
    _timed(torch_backend.CapturedCallable, "replay", "fwd: replay (incl. _Replay fwd)")
    _timed(torch_backend.CallSignature, "tensors_of", "fwd: dispatcher signature match")
    _timed(torch_backend._Replay, "backward", "bwd: _Replay.backward")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=16, help="real GPUs: e.g. 1024 (bench h1024)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="count (fake) CUDA API calls")
    ap.add_argument("--eager", action="store_true", help="no graphs (eager FSDP layers)")
    ap.add_argument("--bare", action="store_true", help="no FSDP, no graphs")
    ap.add_argument("--breakdown", action="store_true", help="time each FSDP/replay piece")
    ap.add_argument("--digest", action="store_true", help="print a digest of the parameters")
    ap.add_argument(
        "--nvtx", action="store_true", help="with --cuda: emit graph_fsdp's NVTX ranges (as nsys)"
    )
    ap.add_argument("--real", action="store_true", help="real GPUs and NCCL (under torchrun)")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 main weights")
    ap.add_argument(
        "--c10d", action="store_true", help="collectives through torch.distributed's Python"
    )
    ap.add_argument(
        "--no-comm-graphs",
        action="store_true",
        help="gathers and reductions issued eagerly (LayerwiseGraphs(comm_graphs=False))",
    )
    args = ap.parse_args()
    if args.c10d:
        import graph_fsdp.fsdp.comm as comm  # noqa: PLC0415

        comm.DIRECT_COLLECTIVES = False

    if args.nvtx:
        os.environ["GRAPH_FSDP_NVTX"] = "1"
    if not args.real:
        install_fakes(args.cuda)
    if args.breakdown:
        install_timers()
    device = "cpu"
    if args.real:
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)

    from graph_fsdp.capture.layerwise import LayerwiseGraphs  # noqa: PLC0415
    from graph_fsdp.fsdp.api import BufferPolicy, MixedPrecisionPolicy  # noqa: PLC0415
    from graph_fsdp.models import GPTConfig, build_model  # noqa: PLC0415
    from graph_fsdp.training.train import TrainConfig, make_optimizer, shard_model  # noqa: PLC0415

    mcfg = GPTConfig(
        vocab_size=args.vocab,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        seq_length=args.seq,
    )
    cfg = TrainConfig(
        model=mcfg,
        buffers=BufferPolicy(allocator="double_buffer", persist_on_alloc_fail=True),
        mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None),
        fused_optimizer=args.real,
    )
    model = build_model(mcfg, device=device)
    if not args.bare:
        model = shard_model(model, cfg)
    opt = make_optimizer(model.parameters(), cfg)
    graphs = None
    if not (args.eager or args.bare):
        graphs = LayerwiseGraphs(
            model,
            impl="torch",
            scopes=[],
            warmup_steps=2,
            warmup_iters=1,
            comm_graphs=not args.no_comm_graphs,
        )
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (1, args.seq), generator=g).to(device)
    y = torch.randint(0, args.vocab, (1, args.seq), generator=g).to(device)
    sync = torch.cuda.synchronize if args.real else (lambda: None)

    fwd, bwd, steps = [], [], []

    def step(prof=None):
        if graphs is not None:
            graphs.before_step()
        sync()
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        loss = model(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if prof:
            prof.disable()
        opt.step()
        opt.zero_grad()
        sync()
        steps.append(time.perf_counter() - t0)
        return t1 - t0, t2 - t1

    for _ in range(5):
        step()
    steps.clear()
    if graphs is not None:
        assert graphs.captured, "graphs were not captured"
    COUNTS.clear()
    TIMES.clear()
    prof = cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        f, b = step(prof)
        fwd.append(f)
        bwd.append(b)
    if graphs is not None:
        rep = graphs.report()
        assert rep["eager_fallbacks"] == 0, rep
    L = args.layers

    def med(v):
        return sorted(v)[len(v) // 2] * 1e6 / L

    mode = "bare" if args.bare else "eager" if args.eager else "graphed"
    if graphs is not None and not args.no_comm_graphs and args.real:
        mode += f", comm graphs {rep['comm_graphs']}"
    if dist.get_rank() == 0:
        where = f"real {torch.cuda.get_device_name()}" if args.real else "fakes"
        print(
            f"{mode} ({where}): host us/layer  forward {med(fwd):.1f}  backward {med(bwd):.1f}"
            f"  step {med(steps) * L / 1e3:.2f} ms"
        )
    if args.breakdown:
        n = args.steps * L
        for k in sorted(TIMES):
            print(f"  {k:58s} {TIMES[k] * 1e6 / n:6.1f} us/layer")
    if args.cuda:
        per = {k: v / (args.steps * L) for k, v in sorted(COUNTS.items())}
        print("fake CUDA calls per layer per step (fwd+bwd):", per)
    if prof and dist.get_rank() == 0:
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s).sort_stats("tottime")
        stats.print_stats(45)
        stats.print_callers(r"copy_|mul_|zero_|add_|all_gather|reduce_scatter")
        stats.print_callees(r"pre_forward|param_group.py.*\(unshard\)|_replay_backward")
        print(s.getvalue())
    if args.digest:
        import hashlib  # noqa: PLC0415

        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
            if p.grad is not None:
                h.update(p.grad.detach().contiguous().numpy().tobytes())
        print("digest", h.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
