"""ChildCalls (models/child_process.py): functions called in children of ours, one child a calling thread,
each a child of a helper's; a child that dies fails its call at once and marks the helper down. The children
are real processes; the functions called are the standard library's, which any child imports."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

import pytest

from stream_recon.models.child_process import ChildCalls, ChildDied, _portable, keep_freed_memory
from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull

POLICY = HelperPolicy("the test's workers", WhenFull.DROP, WhenDown.FAIL_RUN, stall_s=30.0)


def on_thread(function, *args):
    """function(*args) on a thread of its own: what it returned, or what it raised."""
    outcome = {}

    def run():
        try:
            outcome["value"] = function(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return outcome


def test_each_thread_calls_a_child_of_its_own_and_keeps_it() -> None:
    calls = ChildCalls(Helper(POLICY))
    try:
        mine = calls.call(os.getpid)
        assert mine != os.getpid() and calls.call(os.getpid) == mine
        other = on_thread(calls.call, os.getpid)["value"]
        assert other not in (mine, os.getpid())
        assert calls.call(divmod, 17, 5) == (3, 2)
    finally:
        calls.close()


def test_a_functions_error_comes_back_as_itself_and_the_child_serves_on() -> None:
    calls = ChildCalls(Helper(POLICY))
    try:
        with pytest.raises(ValueError, match="invalid literal"):
            calls.call(int, "not a number")
        assert calls.call(int, "12") == 12
    finally:
        calls.close()


def test_an_error_that_cannot_cross_the_pipe_is_named_in_words() -> None:
    class LocalError(Exception):  # (a local class: pickle cannot name it)
        pass

    portable = _portable(LocalError("the reason"))
    assert isinstance(portable, RuntimeError) and str(portable) == "LocalError: the reason"
    plain = ValueError("kept")
    assert _portable(plain) is plain


def test_setup_runs_once_in_each_child_before_its_first_call() -> None:
    calls = ChildCalls(Helper(POLICY), setup="faulthandler.enable")
    try:
        assert calls.call(faulthandler.is_enabled) is True
    finally:
        calls.close()


def test_a_child_killed_mid_call_fails_that_call_at_once_and_marks_its_helper_down() -> None:
    helper = Helper(POLICY)
    calls = ChildCalls(helper)
    pid = {}

    def sleep_in_child():
        pid["child"] = calls.call(os.getpid)
        return calls.call(time.sleep, 60)

    try:
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.update(on_thread(sleep_in_child)))
        thread.start()
        deadline = time.monotonic() + 20
        while "child" not in pid and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # (the sleep has been sent)
        killed = time.monotonic()
        os.kill(pid["child"], signal.SIGKILL)
        thread.join(10)
        assert time.monotonic() - killed < 1.0
        assert isinstance(outcome.get("error"), ChildDied), outcome
        assert f"pid {pid['child']}" in str(outcome["error"]) and "exit status -9" in str(outcome["error"])
        assert not helper.is_up
    finally:
        calls.close()


def test_close_ends_every_child() -> None:
    calls = ChildCalls(Helper(POLICY))
    pids = [calls.call(os.getpid), on_thread(calls.call, os.getpid)["value"]]
    calls.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# In a child, by `eval` (a builtin: the child imports nothing of the tests): the kB its resident memory keeps
# after a 16 MiB array is made, touched and freed.
KEPT_AFTER_AN_ARRAY = ("(lambda np, rss: (lambda before: (np.ones(2 << 20).sum(), rss() - before)[1])(rss()))("
                       "__import__('numpy'), lambda: int([line for line in open('/proc/self/status') "
                       "if line.startswith('VmRSS')][0].split()[1]))")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_refines_worker_children_keep_freed_memory_for_their_next_job() -> None:
    """Refine's children keep what a job frees (keep_freed_memory): a freed 16 MiB array stays in the heap for
    the next job, where a plain child returns it to the system."""
    kept = {}
    for name, setup in (("refine's", "stream_recon.app.outputs.refined.set_up_worker_child"), ("plain", None)):
        calls = ChildCalls(Helper(POLICY), setup=setup)
        try:
            calls.call(eval, "__import__('numpy').ones(8).sum()")  # (numpy imported, its small arrays made)
            kept[name] = calls.call(eval, KEPT_AFTER_AN_ARRAY)
        finally:
            calls.close()
    assert kept["refine's"] > 12_000 > 4_000 > kept["plain"], kept
    assert keep_freed_memory() is True
