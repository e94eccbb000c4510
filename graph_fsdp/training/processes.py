"""Run a function on every rank: spawned local processes, or in-process under a launcher.

    results = spawn(fn, 2)                 # fn(rank, world_size) in 2 fresh gloo processes
    result = launch(plan, fn, *args)       # rank 0's result, spawned or under torchrun

:func:`spawn` starts ``world_size`` fresh processes, makes each one's process group
(:func:`graph_fsdp.init_distributed`) and returns every rank's result; it never hangs on a
rank that died. :func:`launch` runs a command's ranks as its :class:`LaunchPlan` says: under
``torchrun`` (``RANK``/``WORLD_SIZE`` set) every process runs its own rank in-process,
without a launcher the local ranks are spawned (one NCCL process per GPU, or gloo processes
on a CPU-only machine). Either way only rank 0's result comes back to the caller, the one
process that prints and writes reports.
"""

from __future__ import annotations

import gc
import importlib.util
import io
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graph_fsdp.distributed import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, init_distributed
from graph_fsdp.training.interrupt import (
    install_stop_handlers,
    request_stop,
    stop_requested,
    stop_signal,
)
from graph_fsdp.training.lifeline import die_with_parent
from graph_fsdp.training.supervision import Interrupted, WorkerIO, supervise


def preload_te() -> None:
    """Import TransformerEngine (if installed) before this process does any CUDA work.

    TE loads the system cuDNN libraries; imported after torch has loaded its own cuDNN
    (by a first attention kernel) it fails with an undefined cuDNN symbol - measured on the
    GPU host, where the bench's TE and megatron_fsdp rows ran after eager rows. Every CUDA
    rank :func:`spawn` or :func:`launch` starts calls this first. An installed but broken TE
    is left for the code that needs it to report.
    """
    if importlib.util.find_spec("transformer_engine") is None:
        return
    try:
        import transformer_engine.pytorch  # noqa: F401, PLC0415 (optional; loaded first on purpose)
    except (ImportError, OSError):
        pass


@dataclass(frozen=True)
class StartMethod:
    """How :func:`spawn` starts its ranks (:func:`set_start_method`)."""

    name: str = "spawn"
    """``spawn``: a fresh interpreter per rank, as a launcher starts them. ``forkserver``:
    each rank forked from one server process ([Note: forkserver ranks])."""
    preload: tuple[str, ...] = ()
    """forkserver: the modules the server imports once, before it forks any rank."""


_START = [StartMethod()]
"""The start method of this process's :func:`spawn` calls (one entry; set_start_method)."""

START_METHODS = ("spawn", "forkserver")


def set_start_method(name: str, *, preload: tuple[str, ...] = ()) -> None:
    """Start the ranks of this process's later :func:`spawn` calls by ``name`` (one of
    :data:`START_METHODS`; ``preload``: the forkserver's modules). The test suite's CPU runs
    use ``forkserver`` with torch preloaded; commands keep ``spawn``.

    [Note: forkserver ranks] Importing torch costs a rank seconds of CPU, more than a tiny
    model's training; a suite that starts hundreds of gloo ranks on 2 cores spends most of its
    time there. A forkserver imports ``preload`` once (no CUDA, no threads) and forks each
    rank from it, so a rank starts in milliseconds. What differs from ``spawn`` is handled in
    the rank's entry: the environment is this process's at the :func:`spawn` call (sent along
    and restored, not the server's from when it started), and the rank dies with its parent,
    the server, which exits when this process dies (lifeline.py [Note: ranks die with their
    launcher], one link longer). A rank still runs in a process of its own, with module state
    as imported and nothing of this process's (its tensors, its process groups).
    """
    if name not in START_METHODS:
        raise ValueError(f"set_start_method({name!r}): one of {START_METHODS}")
    _START[0] = StartMethod(name, tuple(preload))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    fn: Callable,
    world_size: int,
    port: int,
    backend: str,
    args: tuple,
    conn,
    pg_timeout_s: float | None,
    parent_pid: int,
    env: dict[str, str] | None = None,
) -> None:
    if env is not None:  # a forkserver's rank: [Note: forkserver ranks]
        os.environ.clear()
        os.environ.update(env)
        parent_pid = os.getppid()  # the server, which dies with the caller of spawn
    die_with_parent(parent_pid)  # lifeline.py [Note: ranks die with their launcher]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    ok = False
    if backend == "gloo":
        # One intra-op thread per rank, as torchrun's default OMP_NUM_THREADS=1: several ranks
        # on a few cores oversubscribe them, and multi-threaded CPU kernels (MKL, OpenMP) can
        # then sum in another order from run to run, which breaks bit-exact comparisons
        # between two launches (seen twice in CI-like runs on 2 cores).
        torch.set_num_threads(1)
    try:
        if backend == "nccl":
            preload_te()
        init_distributed(backend, timeout_s=pg_timeout_s, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()  # plain bytes: shared-memory tensors die with the child
        torch.save(result, buf)
        conn.send(("ok", buf.getvalue()))
        ok = True
    except BaseException:  # report any failure to the parent, then re-raise
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        conn.close()
        if ok and dist.is_initialized():
            # Collect cycles that keep the engine (and its group) alive first, so that the group
            # really is destroyed here, not by a gloo thread during interpreter shutdown.
            gc.collect()
            dist.destroy_process_group()


DEAD_GRACE_S = 3.0
"""A rank that exited this long ago without reporting died (killed, os._exit, a crash)."""
FAIL_GRACE_S = 90.0
"""After a failure, how long the other ranks get to report (their errors) before they are
killed: longer than the default process-group timeout, so a rank waiting on a dead peer
fails on its own first (a shorter process-group timeout shortens it: :func:`_fail_grace`)."""
TIMED_OUT_GRACE_S = 5.0
"""After a first failure that is a collective's timeout (or a peer gone), how long the silent
ranks get before they count as hung: their peers have waited the whole timeout for them."""


def spawn(
    fn: Callable,
    world_size: int = 2,
    *args,
    backend: str = "gloo",
    timeout: float | None = None,
    pg_timeout_s: float | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes (started as
    :func:`set_start_method` says); return results.

    ``fn`` must be importable (module level). The groups are made by
    :func:`graph_fsdp.init_distributed` with ``pg_timeout_s`` (None: its default, 60 s). Never hangs: a rank that exits
    without reporting, or a run past ``timeout`` seconds (None: no bound), fails the call. Raises with every
    failing rank's traceback (and the ranks that died or were terminated).
    """
    for attempt in range(PORT_ATTEMPTS):
        outcome = _launch(fn, world_size, args, backend, timeout, pg_timeout_s)
        if not (_port_taken(outcome) and attempt + 1 < PORT_ATTEMPTS):
            break
    failures = [
        f"rank {r} {'hung' if status == 'hung' else 'failed'}:\n{payload}"
        for r, (status, payload) in sorted(outcome.items(), key=lambda kv: kv[1][0] != "hung")
        if status != "ok"
    ]
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        failures.append(f"ranks {missing} did not finish in time and were killed")
    if failures:
        raise RuntimeError("\n".join(failures))
    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]


PORT_ATTEMPTS = 3
"""``free_port`` only finds a port free at that moment: another process (an NCCL bootstrap of
a parallel job) can take it before rank 0 listens. Such a launch is retried on a new port."""


def _port_taken(outcome: dict) -> bool:
    return any(
        status != "ok" and "EADDRINUSE" in str(payload) for status, payload in outcome.values()
    )


def _launch(fn, world_size, args, backend, timeout, pg_timeout_s) -> dict:
    start = _START[0]
    ctx = mp.get_context(start.name)
    env = None
    if start.name == "forkserver":
        ctx.set_forkserver_preload(list(start.preload))
        env = dict(os.environ)
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_entry,
            args=(
                r,
                fn,
                world_size,
                port,
                backend,
                args,
                pipes[r][1],
                pg_timeout_s,
                os.getpid(),
                env,
            ),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for _, child_end in pipes:
        child_end.close()
    outcome = _collect(procs, [parent for parent, _ in pipes], timeout, _pg_timeout(pg_timeout_s))
    for r, p in enumerate(procs):
        if r in outcome and outcome[r][0] != "hung":
            p.join(timeout=5)  # a rank that reported: its teardown
        if p.is_alive():  # hung, silent, or stuck in teardown (SIGTERM is a stop request there)
            p.kill()
            p.join(timeout=5)
    return outcome


def _pg_timeout(pg_timeout_s: float | None) -> float:
    """The process groups' timeout the ranks get (init_distributed's rule)."""
    if pg_timeout_s is not None:
        return pg_timeout_s
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def _collect(
    procs: list, conns: list, timeout: float | None, pg_timeout_s: float
) -> dict[int, tuple[str, object]]:
    """Each rank's ``(status, payload)`` as it arrives; stops when every rank is accounted
    for, a grace after the first failure (:func:`_fail_grace`), or at ``timeout``.

    [Note: hung ranks] A rank that stops answering (stopped by SIGSTOP, a debugger, a
    deadlock) never fails itself: its peers' collectives time out after ``pg_timeout_s`` and
    they report that. The rank is then named as hung (status ``"hung"``), and so is a rank
    the kernel shows stopped for longer than the timeout (Linux /proc, even when every rank is
    stopped); the launcher kills hung ranks, so the command ends about one timeout after the
    hang instead of never.
    """
    start = time.monotonic()
    outcome: dict[int, tuple[str, object]] = {}
    exited_at: dict[int, float] = {}
    stopped_at: dict[int, float] = {}
    first_failure: float | None = None
    grace = FAIL_GRACE_S
    while len(outcome) < len(procs):
        now = time.monotonic()
        if timeout is not None and now - start > timeout:
            break
        if first_failure and now - first_failure > grace:
            for r in range(len(procs)):
                if r not in outcome and procs[r].is_alive():
                    outcome[r] = ("hung", _silent(grace, pg_timeout_s))
            break
        pending = {conns[r]: r for r in range(len(procs)) if r not in outcome}
        for conn in mp_connection.wait(list(pending), timeout=0.5):
            r = pending[conn]
            try:
                outcome[r] = conn.recv()
            except EOFError:  # closed without a message: the rank died
                continue
            if outcome[r][0] != "ok" and first_failure is None:
                first_failure = time.monotonic()
                grace = _fail_grace(str(outcome[r][1]), pg_timeout_s)
            if _port_taken({r: outcome[r]}):
                return outcome  # the peers wait for a store that never listens: retry now
        for r, p in enumerate(procs):
            if r in outcome:
                continue
            if p.is_alive():
                if _stopped(p.pid):
                    stopped_at.setdefault(r, time.monotonic())
                    if time.monotonic() - stopped_at[r] > pg_timeout_s:
                        outcome[r] = ("hung", _stopped_for(pg_timeout_s))
                        first_failure = first_failure or time.monotonic()
                        grace = min(grace, TIMED_OUT_GRACE_S)
                else:
                    stopped_at.pop(r, None)
                continue
            exited_at.setdefault(r, time.monotonic())
            if time.monotonic() - exited_at[r] > DEAD_GRACE_S:
                outcome[r] = (
                    "died",
                    f"exited with code {p.exitcode} without reporting (killed, os._exit or a "
                    "crash); the other ranks' collectives with it fail (see their errors)",
                )
                first_failure = first_failure or time.monotonic()
    return outcome


_TIMED_OUT = ("timed out", "connection closed by peer", "connection reset by peer")
"""A first failure of these kinds means a peer went silent or away, not a bug of its own."""


def _fail_grace(message: str, pg_timeout_s: float) -> float:
    """How long the other ranks get to report after the first failure (``message``): short
    when it is a collective that waited the whole timeout for them, else long enough for a
    rank waiting on the failed one to time out itself."""
    low = "\n".join(message.lower().strip().splitlines()[-5:])  # the exception, not the frames
    if any(k in low for k in _TIMED_OUT):
        return TIMED_OUT_GRACE_S
    return min(FAIL_GRACE_S, pg_timeout_s + 30.0)


def _silent(grace: float, pg_timeout_s: float) -> str:
    return (
        f"no answer {grace:g} s after a peer's failure, whose collectives waited the "
        f"{pg_timeout_s:g} s distributed timeout for it (--distributed-timeout-minutes); killed"
    )


def _stopped_for(pg_timeout_s: float) -> str:
    return (
        f"stopped (SIGSTOP, a debugger) for longer than the {pg_timeout_s:g} s distributed "
        "timeout (--distributed-timeout-minutes); killed"
    )


def _stopped(pid: int) -> bool:
    """Whether the kernel shows ``pid`` stopped (Linux /proc state T or t); False elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Resolved device, backend and world size of a command (no GPU work done yet)."""

    device: str
    """cpu or cuda."""
    backend: str
    """gloo (cpu) or nccl (cuda)."""
    world_size: int
    """Data-parallel ranks."""
    under_launcher: bool
    """True under torchrun: this process is one rank, the others already exist."""
    rank: int = 0
    """This process's rank under a launcher (0 when the CLI spawns the ranks)."""
    local_rank: int = 0
    """This process's GPU under a launcher."""

    def describe(self) -> str:
        how = "torchrun" if self.under_launcher else "spawned"
        return f"{self.world_size} x {self.device} ({self.backend}, {how})"


def _rank_entry(
    rank: int, world_size: int, device: str, io: WorkerIO, fn: Callable, *args: object
) -> object:
    install_stop_handlers()  # interrupt.py; until now SIGINT is ignored (supervision.py)
    early = io.signal_before_start()
    if early is not None:
        request_stop(early)
    io.redirect(rank)  # supervision.py [Note: quiet ranks]
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Local gloo ranks share the machine's cores; oversubscription makes steps erratic.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        result = fn(rank, world_size, *args)
    except BaseException as err:
        io.record_failure(rank, err)
        raise
    if rank == 0 and stop_requested():  # the launcher need not wait for the teardown
        io.keep_stopped_result(result, stop_signal())
    _finish_together(world_size)
    return result


def _finish_together(world_size: int) -> None:
    """Leave the process group in a state that can be destroyed before interpreter exit.

    [Note: gloo teardown] A gloo worker thread frees the last collectives' work objects,
    which hold Python thread-local state; if that happens while the interpreter finalises,
    the thread cannot take the GIL and the process aborts ("terminate called without an
    active exception"). So: every rank finishes its collectives (barrier), and reference
    cycles that keep the engine and its group alive are collected now, so that
    ``destroy_process_group`` really destroys the group (joining its threads, GIL released)
    while Python is still fully alive.
    """
    if world_size > 1 and dist.is_initialized():
        dist.barrier()
    gc.collect()


def launch(plan: LaunchPlan, fn: Callable, *args: object) -> object | None:
    """Run ``fn(rank, world_size, *args)`` on every rank; return rank 0's result.

    Returns None in the processes of other ranks under a launcher (they report nothing).
    ``fn`` must be a module-level function (it is pickled by reference when spawning).
    Raises :class:`RankFailure` (one line; the tracebacks in a log it names) when a spawned
    rank failed, :class:`Interrupted` when SIGINT/SIGTERM stopped the run (supervision.py).
    """
    if not plan.under_launcher:

        def run(io: WorkerIO) -> list:
            return spawn(
                _rank_entry, plan.world_size, plan.device, io, fn, *args, backend=plan.backend
            )

        name = getattr(fn, "__name__", "").removesuffix("_worker").strip("_") or "run"
        return supervise(plan.world_size, name, run)
    install_stop_handlers()  # this process is one rank: interrupt.py
    initialised_here = not dist.is_initialized()
    if initialised_here:
        if plan.device == "cuda":
            preload_te()
        # Bounded collective timeout and NCCL watchdog settings (graph_fsdp/distributed.py).
        init_distributed(plan.backend)
    try:
        result = fn(plan.rank, plan.world_size, *args)
        _finish_together(plan.world_size)
    finally:
        if initialised_here and dist.is_initialized():
            dist.destroy_process_group()
            gc.collect()  # see [Note: gloo teardown]
    if stop_requested():
        raise Interrupted(stop_signal(), result if plan.rank == 0 else None)
    return result if plan.rank == 0 else None
