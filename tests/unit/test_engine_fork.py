"""The engine process's fork start (services/worker/engine_host/fork.py), in a fresh interpreter of its own: a
fork is allowed only before any other thread or torch's thread pool starts, and a forked child that detached
from its parent neither reaches the parent's asyncio signal handlers nor dies of a Ctrl-C to the group."""

from __future__ import annotations

import subprocess
import sys
import textwrap

ALONE = textwrap.dedent(
    """
    import threading, time
    import torch
    from services.worker.engine_host.fork import may_fork

    report = {"fresh": may_fork()}
    thread = threading.Thread(target=time.sleep, args=(0.5,))
    thread.start()
    report["thread running"] = may_fork()
    thread.join()
    ended_by = time.monotonic() + 2  # the kernel drops the thread's /proc/self/task entry a moment after join returns
    while not may_fork() and time.monotonic() < ended_by:  # (a suite run on a loaded 2-core box saw it still there)
        time.sleep(0.01)
    report["thread ended"] = may_fork()
    a = torch.ones(512, 512)
    (a @ a).sum()  # starts torch's thread pool (a second thread on two cores)
    report["after a parallel op"] = may_fork() if torch.get_num_threads() > 1 else False
    print(report)
    """
)

UNDER_A_LOOP = textwrap.dedent(
    """
    import asyncio, os, signal, time
    from services.worker.engine_host.fork import detach_from_parent, signals_blocked

    async def fork_under_a_loop():
        # as a worker runs: SIGINT and SIGTERM handled by its loop, the engine's child forked under it
        received = []
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, received.append, sig)
        with signals_blocked():
            pid = os.fork()
        if pid == 0:
            detach_from_parent()
            os.kill(os.getpid(), signal.SIGINT)  # ignored, and never reaches the parent's loop
            try:
                asyncio.get_running_loop()
                os._exit(3)  # the parent's loop still looked running here
            except RuntimeError:
                pass
            time.sleep(0.2)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        await asyncio.sleep(0.3)
        return {"child exit": os.waitstatus_to_exitcode(status), "parent signals": received}

    print(asyncio.run(fork_under_a_loop()))
    """
)


def _report(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 (our own script's dict literal)


def test_a_fork_is_allowed_only_while_the_process_runs_nothing_but_its_main_thread() -> None:
    assert _report(ALONE) == {
        "fresh": True,
        "thread running": False,
        "thread ended": True,
        "after a parallel op": False,
    }


def test_a_detached_child_stays_out_of_its_parents_signal_handling() -> None:
    assert _report(UNDER_A_LOOP) == {"child exit": 0, "parent signals": []}
