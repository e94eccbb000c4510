"""Spawned ranks die with the process that spawned them.

    die_with_parent(launcher_pid)     # first thing in each spawned rank (processes.py)

[Note: ranks die with their launcher] A rank outlives a launcher that was killed (``kill -9``,
an out-of-memory kill, a crashed IDE): nothing else tells it, so it trains on to the end
and then fails to report to a pipe nobody reads. Each rank therefore asks the kernel for a
SIGKILL when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, through ctypes) and then
checks that the parent is still the launcher (it may have died before the call: the rank is
then an orphan already and exits). SIGKILL, not SIGTERM: a rank's SIGTERM is a stop request
(interrupt.py) whose step-boundary stop would end in a report to the dead launcher, and a
rank blocked in a collective with a peer that is going too would wait for the process-group
timeout. Where prctl is unavailable (another OS, a libc without it) a daemon thread polls the
parent pid every :data:`POLL_S` seconds instead. The kernel's signal fires when the *thread*
that spawned the rank exits: the launcher's spawning thread outlives its ranks (it collects
their results), so that is the launcher's death in practice.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
"""``<sys/prctl.h>``: the signal this process gets when its parent thread dies."""

POLL_S = 0.5
"""The watchdog's period: a rank outlives its launcher by at most this long (plus a step's
work that no signal interrupts)."""

MODE_ENV = "GRAPH_FSDP_PARENT_DEATH"
"""``watchdog``: use the polling thread even where prctl works (for tests of the fallback)."""


def die_with_parent(parent_pid: int) -> str:
    """Make this process die (SIGKILL) when ``parent_pid``, its parent, dies; return how:
    ``"prctl"`` or ``"watchdog"``. A process whose parent is gone already dies now."""
    if os.environ.get(MODE_ENV) != "watchdog" and _set_pdeathsig(signal.SIGKILL):
        _exit_if_orphan(parent_pid)  # the parent may have died before the call
        return "prctl"
    _exit_if_orphan(parent_pid)
    thread = threading.Thread(
        target=_watch, args=(parent_pid,), name="graph-fsdp-parent-watch", daemon=True
    )
    thread.start()
    return "watchdog"


def _set_pdeathsig(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc symbol: the watchdog does it
        return False


def _exit_if_orphan(parent_pid: int) -> None:
    if os.getppid() != parent_pid:  # reparented to init or a subreaper: the parent died
        os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent_pid: int) -> None:
    while True:
        time.sleep(POLL_S)
        _exit_if_orphan(parent_pid)
