"""The launcher's side of spawned ranks: stop signals forwarded, output kept quiet, failures in
one line.

[Note: quiet ranks] Without ``--verbose`` (or ``GRAPH_FSDP_VERBOSE=1``) each spawned rank
sends what it writes to file descriptor 2 - tracebacks, gloo/NCCL teardown messages ("terminate
called ...", connection resets of peers that stopped), warnings of ranks other than 0 - to one
log file shared by the ranks; rank 0's Python ``sys.stderr`` (its progress bar and notes)
stays on the terminal. A rank that raises appends its traceback to the log and one JSON record
(rank, exception, message, time) to a side file; the launcher then prints one line naming the
rank whose error came first (errors that only say a peer went away rank last) and the log.
With ``--verbose`` nothing is redirected.

[Note: stop signals in the launcher] While local ranks run, SIGINT/SIGTERM to the launcher are
forwarded to every rank (interrupt.py stops them at the next step boundary, a second signal at
once); the launcher waits :data:`STOP_GRACE_S` for them (:data:`AT_ONCE_S` after a second
signal), kills the rest, and the command exits with 128 + the signal number (130 for SIGINT).
The ranks start with SIGINT ignored (a disposition exec keeps) until their own handlers are in
place, so a Ctrl-C during their start prints no KeyboardInterrupt traceback: the launcher
ignores SIGINT for the milliseconds in which the rank processes are created, then installs
its handler (SIGTERM's is in place before: children get the default action for it, a quiet
exit). A SIGINT in that window is held pending and delivered afterwards when the launcher has
no other threads; with other threads (a BLAS pool) one of them may take and drop it - press
Ctrl-C again. A signal the launcher forwards while a rank is still starting would be ignored
there, so the launcher first writes it to a stop file, which each rank reads once its
handlers are installed.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graph_fsdp.training.interrupt import STOP_SIGNALS

VERBOSE_ENV = "GRAPH_FSDP_VERBOSE"
"""``1``: the ranks' output and tracebacks go to the terminal (``--verbose`` sets it)."""

STOP_GRACE_S = float(os.environ.get("GRAPH_FSDP_STOP_GRACE_S", "7"))
"""Seconds the ranks get to reach a step boundary (and save) after a stop signal; then they
are killed, so that the command ends within 10 s (environment: GRAPH_FSDP_STOP_GRACE_S, e.g.
longer for checkpoints that take longer to write)."""

AT_ONCE_S = 2.0
"""Seconds the ranks get to exit after a second stop signal, or to tear down after rank 0
reported where a stopped run ended."""

_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket timeout",
    "timed out",
    "nccl communicator was aborted",
    "process group watchdog",
    "did not finish in time",
)
"""Messages of errors that follow another rank's failure (its peers' collectives fail)."""


class RankFailure(RuntimeError):
    """A spawned rank failed; the message is one line: the rank, its exception, the log."""


class Interrupted(Exception):
    """A stop signal ended the command; ``result`` is rank 0's (partial) result when the ranks
    stopped at a step boundary, None when they had to be killed."""

    def __init__(
        self, signum: int, result: object | None, *, forced: bool = False, signals: int = 1
    ) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.result, self.forced, self.signals = signum, result, forced, signals

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def describe(self) -> str:
        if not self.forced:
            how = "the ranks stopped at a step boundary"
        elif self.signals > 1:
            how = "stopped at once (a second signal)"
        else:
            how = f"the ranks did not stop within {STOP_GRACE_S:g} s and were killed"
        return f"interrupted by {signal.Signals(self.signum).name}: {how}"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


_CONSOLE = None
"""Rank 0's terminal stream while its file descriptor 2 goes to the log ([Note: quiet ranks])."""


def console():
    """Where rank 0 writes for the user (its progress bar): the terminal."""
    return _CONSOLE or sys.stderr


@dataclass(frozen=True, kw_only=True)
class WorkerIO:
    """Where the spawned ranks' output and failure records go ([Note: quiet ranks])."""

    log_path: str
    failures_path: str
    result_path: str
    stop_path: str
    verbose: bool

    @classmethod
    def create(cls, name: str) -> WorkerIO:
        stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
        fd, log = tempfile.mkstemp(prefix=f"graph-fsdp-{name}-{stamp}-", suffix=".log")
        os.close(fd)
        return cls(
            log_path=log,
            failures_path=log + ".failures",
            result_path=log + ".result",
            stop_path=log + ".stop",
            verbose=verbose(),
        )

    # ------------------------------------------------------------------ in the ranks
    def signal_before_start(self) -> int | None:
        """The stop signal the launcher got before this rank could handle it, or None."""
        try:
            with open(self.stop_path) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def redirect(self, rank: int) -> None:
        """This rank's fd 2 to the log; rank 0 keeps the terminal for ``sys.stderr``."""
        global _CONSOLE
        if self.verbose:
            return
        sys.stderr.flush()
        terminal = os.dup(2)
        log = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 2)
        os.close(log)
        if rank == 0:
            _CONSOLE = sys.stderr = os.fdopen(terminal, "w", buffering=1)
        else:
            os.close(terminal)
            sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)

    def record_failure(self, rank: int, err: BaseException) -> None:
        """The traceback into the log, one record for the launcher; later output of this rank
        (the traceback multiprocessing prints) goes to the log too."""
        text = "".join(traceback.format_exception(err))
        lines = str(err).strip().splitlines()
        record = {
            "rank": rank,
            "type": type(err).__name__,
            "message": lines[0] if lines else "",
            "more_lines": max(0, len(lines) - 1),
            "time": time.time(),
        }
        with open(self.log_path, "a") as f:
            f.write(f"--- rank {rank} failed:\n{text}\n")
        with open(self.failures_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if not self.verbose:
            sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)

    def keep_stopped_result(self, result: object, signum: int) -> None:
        """Rank 0 of a run a signal stopped: its result, for a launcher that cannot wait for
        the ranks' teardown (process-group destruction and garbage collection can take
        seconds), and the signal (which may have reached the ranks only)."""
        tmp = self.result_path + ".part"
        torch.save({"result": result, "signum": signum}, tmp)
        os.replace(tmp, self.result_path)

    # ------------------------------------------------------------------ in the launcher
    def stopped_result(self) -> tuple[int | None, object]:
        """``(signal, rank 0's result)`` kept by :meth:`keep_stopped_result`; ``(None, None)``
        when no rank was stopped."""
        if not os.path.exists(self.result_path):
            return None, None
        kept = torch.load(self.result_path, weights_only=False)
        return kept["signum"], kept["result"]

    def failure_line(self, spawn_error: BaseException) -> str:
        """One line: the rank whose error came first, its exception and message, the log."""
        with open(self.log_path, "a") as f:
            f.write(f"--- launcher: {spawn_error}\n")
        records = []
        if os.path.exists(self.failures_path):
            with open(self.failures_path) as f:
                records = [json.loads(line) for line in f if line.strip()]
        died = _DIED.findall(str(spawn_error))
        hung = _HUNG.findall(str(spawn_error))
        first = min(records, key=lambda r: (_peer_gone(r["message"]), r["time"]), default=None)
        if died and (first is None or _peer_gone(first["message"])):
            rank, code = died[0]
            how = f"code {code}"
            if int(code) < 0 and -int(code) in signal.valid_signals():
                how = f"signal {signal.Signals(-int(code)).name}"
            what = f"rank {rank} died without an error (exit {how}: killed, or a crash)"
            if first is not None:
                what += f"; then rank {first['rank']}: {first['type']}: {first['message']}"
        elif hung and (first is None or _peer_gone(first["message"])):
            rank, why = hung[0]
            what = f"rank {rank} hung: {why}"
            if first is not None:
                what += f"; then rank {first['rank']}: {first['type']}: {first['message']}"
        elif first is not None:
            what = f"rank {first['rank']} failed: {first['type']}: {first['message']}"
            if first.get("more_lines"):
                what += f" (+{first['more_lines']} lines in the log)"
            others = len({r["rank"] for r in records}) - 1
            if others:
                what += f" ({others} more rank{'s' if others > 1 else ''} failed after it)"
        else:
            lines = [ln.strip() for ln in str(spawn_error).splitlines() if ln.strip()]
            what = " ".join(lines[:2]) if lines else type(spawn_error).__name__
        self._remove_side_files()
        where = "tracebacks above" if self.verbose else f"tracebacks: {self.log_path}"
        return f"{what} [{where}]"

    def finish(self) -> str | None:
        """After a successful launch: drop an empty log; the path of one with content."""
        self._remove_side_files()
        if os.path.exists(self.log_path) and os.path.getsize(self.log_path) == 0:
            os.unlink(self.log_path)
            return None
        return self.log_path if os.path.exists(self.log_path) else None

    def _remove_side_files(self) -> None:
        for side in (self.failures_path, self.result_path, self.stop_path):
            if os.path.exists(side):
                os.unlink(side)


_DIED = re.compile(r"rank (\d+) failed:\s*exited with code (-?\d+) without reporting")
"""A rank that died without reporting, in :func:`graph_fsdp.training.processes.spawn`'s error."""
_HUNG = re.compile(r"rank (\d+) hung:\s*(.*)")
"""A rank the launcher killed as hung (processes.py [Note: hung ranks])."""


def _peer_gone(message: str) -> bool:
    low = message.lower()
    return any(k in low for k in _PEER_GONE)


class _LauncherSignals:
    """[Note: stop signals in the launcher]: counts the signals and forwards them."""

    def __init__(self, stop_path: str) -> None:
        self.stop_path = stop_path
        self.signum: int | None = None
        self.count = 0
        self.deadline: float | None = None

    def handle(self, signum: int, frame) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
            with open(self.stop_path, "w") as f:  # for ranks not yet handling signals
                f.write(str(signum))
        self.deadline = time.monotonic() + (STOP_GRACE_S if self.count == 1 else AT_ONCE_S)
        _signal_children(signum)


def _signal_children(signum: int) -> None:
    for p in multiprocessing.active_children():
        try:
            os.kill(p.pid, signum)
        except ProcessLookupError:
            pass


def supervise(world_size: int, name: str, run: Callable[[WorkerIO], list]) -> object:
    """``run(io)`` (spawns ``world_size`` ranks, returns their results) under the launcher's
    signal handling; rank 0's result. Raises :class:`RankFailure` (one line) when a rank
    failed, :class:`Interrupted` when a stop signal ended the run."""
    io = WorkerIO.create(name)
    if threading.current_thread() is not threading.main_thread():  # no signal handlers here
        try:
            results = run(io)
        except RuntimeError as err:
            raise RankFailure(io.failure_line(err)) from None
        io.finish()
        return results[0]
    box: dict = {}

    def target() -> None:
        try:
            box["results"] = run(io)
        except BaseException as err:  # noqa: BLE001 - handed to the launcher's thread
            box["error"] = err

    signals = _LauncherSignals(io.stop_path)
    thread = threading.Thread(target=target, name="graph-fsdp-ranks", daemon=True)
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        signal.signal(signal.SIGTERM, signals.handle)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the ranks: see the note
        thread.start()
        _wait_for_ranks(world_size, thread)
        signal.signal(signal.SIGINT, signals.handle)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # a pending SIGINT arrives now
        while thread.is_alive():
            thread.join(0.1)
            if signals.deadline is None:
                continue
            if os.path.exists(io.result_path):  # the ranks stopped: only teardown is left
                signals.deadline = min(signals.deadline, time.monotonic() + AT_ONCE_S)
            if time.monotonic() > signals.deadline:
                _signal_children(signal.SIGKILL)
                break
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        for s, handler in old.items():
            signal.signal(s, handler)
    stopped_by, kept = io.stopped_result()
    if signals.signum is not None:
        results = box.get("results")
        io.finish()
        if results is not None:
            raise Interrupted(signals.signum, results[0])
        forced = stopped_by is None
        raise Interrupted(signals.signum, kept, forced=forced, signals=signals.count)
    if "error" in box:
        raise RankFailure(io.failure_line(box["error"])) from None
    log = io.finish()
    if stopped_by is not None:  # the ranks themselves were signalled (not the launcher)
        raise Interrupted(stopped_by, box["results"][0])
    if log is not None:
        print(f"(the ranks' messages: {log})", file=sys.stderr)
    return box["results"][0]


def _wait_for_ranks(world_size: int, thread: threading.Thread, limit_s: float = 60.0) -> None:
    """Until the rank processes exist (they then hold the ignored SIGINT), the launch thread
    ended, or ``limit_s``."""
    end = time.monotonic() + limit_s
    while thread.is_alive() and time.monotonic() < end:
        if len(multiprocessing.active_children()) >= world_size:
            return
        time.sleep(0.002)
