"""Signal handlers that cannot deadlock: nothing in a handler takes a lock or writes a stream.

Python runs a handler on the main thread between two bytecodes, so a handler that needs a lock the
main thread holds at that moment (the watcher's, at every step boundary) hangs the run exactly
when it must checkpoint. These run in a child process with a time limit: a hang is a failure,
not a stuck test worker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

LIMIT_S = 60


def run_child(body: str) -> subprocess.CompletedProcess[str]:
    # A job a shell starts in the background (`cmd &`, nohup) inherits SIGINT ignored, and the watcher
    # rightly leaves an ignored SIGINT alone: the child starts from Python's own handler.
    prelude = "import os, signal, threading, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    code = prelude + textwrap.dedent(body)
    try:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=LIMIT_S, check=False
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the child hung (a handler deadlocked): {err.stdout!r} {err.stderr!r}")


def test_a_signal_while_the_main_thread_holds_the_watchers_lock_does_not_hang():
    # The exact interleaving of the bug: the main thread is inside the watcher's lock (as in
    # take_hint/clear at a step boundary) when the signal's handler runs.
    done = run_child(
        """
        from spot_callbacks.preemption import PreemptionWatcher
        watcher = PreemptionWatcher(["SIGUSR1"]); watcher.start()
        with watcher._lock:
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):  # bytecodes: the handler runs here, still inside the lock
                pass
        notice = watcher.wait(timeout=10)
        print("notice", notice.source if notice else None)
        watcher.stop()
        """
    )
    assert done.returncode == 0, done.stderr
    assert "notice SIGUSR1" in done.stdout


def test_signals_every_2ms_at_step_boundaries_and_inside_a_handler_never_hang():
    # A second signal arrives while the first handler runs (the chained handler sends it), and a
    # thread keeps signalling while the main thread loops over step-boundary calls.
    done = run_child(
        """
        import logging, sys
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        from spot_callbacks.preemption import PreemptionWatcher

        nested = []
        def earlier_handler(signum, frame):  # a framework's own handler, chained after ours
            if not nested:
                nested.append(signum)
                os.kill(os.getpid(), signal.SIGUSR1)  # re-enters our handler inside this one
        signal.signal(signal.SIGUSR1, earlier_handler)

        watcher = PreemptionWatcher(["SIGTERM", "SIGUSR1"]); watcher.start()
        stop = threading.Event()
        sent = [0]
        def sender():
            while not stop.is_set() and sent[0] < 400:
                os.kill(os.getpid(), signal.SIGUSR1 if sent[0] % 2 else signal.SIGTERM)
                sent[0] += 1
                stop.wait(0.002)
        thread = threading.Thread(target=sender); thread.start()
        boundaries = 0
        while thread.is_alive():
            watcher.take_hint(); watcher.notice; watcher.clear()  # the engine's step-boundary calls
            boundaries += 1
        watcher.stop()  # the storm's notices still queued are relayed before its relay thread ends
        after = PreemptionWatcher(["SIGTERM"]); after.start()  # and signals are still watched after it
        os.kill(os.getpid(), signal.SIGTERM)
        print("after", after.wait(timeout=10).source, "sent", sent[0], "nested", len(nested), "boundaries", boundaries)
        after.stop()
        """
    )
    assert done.returncode == 0, done.stderr
    fields = done.stdout.split()
    assert fields[:2] == ["after", "SIGTERM"], done.stdout
    assert int(fields[3]) == 400 and int(fields[5]) == 1 and int(fields[7]) > 0, done.stdout
    assert "reentrant call" not in done.stderr
    assert "preemption notice from SIG" in done.stderr  # the log line is still written, outside


def test_the_handler_itself_writes_nothing_and_takes_no_lock():
    # Every call a handler makes, traced: only the queue's put and the chained handler run in it.
    done = run_child(
        """
        import sys
        from spot_callbacks.preemption import PreemptionWatcher
        watcher = PreemptionWatcher(["SIGUSR1", "SIGINT"]); watcher.start()
        handlers = [signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGINT)]
        called = []
        def trace(frame, event, arg):
            if event in ("call", "c_call"):
                called.append(getattr(arg, "__qualname__", None) if event == "c_call" else frame.f_code.co_qualname)
        for handler, signum in zip(handlers, (signal.SIGUSR1, signal.SIGINT)):
            sys.setprofile(trace); handler(signum, None); sys.setprofile(None)
        print("calls", sorted(set(c for c in called if c)))
        print("notice", watcher.wait(timeout=10).source)
        watcher.stop()
        """
    )
    assert done.returncode == 0, done.stderr
    calls = done.stdout.splitlines()[0]
    for forbidden in ("report", "warning", "acquire", "__enter__", "write", "_deliver_one", "signal_grace_s"):
        assert forbidden not in calls, calls
    assert "SimpleQueue.put" in calls, calls
    assert "notice SIGUSR1" in done.stdout
