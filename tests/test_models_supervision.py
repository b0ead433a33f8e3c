"""The supervision contract every helper of a run keeps (models/supervision.py): hand-offs by their policy
when full, helpers down when they raise or stall, and waits that end at their deadline.

Stalls are timed on a clock of the test's own where the contract reads one (`clock`); waits that block in
the standard library (a full queue, a condition) run for real, against deadlines of a fraction of a second.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
from helpers import wait_until, warnings_of

from stream_recon.models import supervision
from stream_recon.models.supervision import (
    Deadline,
    HandOff,
    Helper,
    HelperDown,
    HelperPolicy,
    WhenDown,
    WhenFull,
    start_supervised_thread,
)


class Clock:
    """supervision's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(supervision, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


def policy(when_full=WhenFull.DROP, when_down=WhenDown.TURN_OFF, stall_s=5.0, push_back_s=0.0) -> HelperPolicy:
    return HelperPolicy("the test helper", when_full, when_down, stall_s=stall_s, push_back_s=push_back_s)


def test_drop_counts_each_item_that_does_not_fit_and_never_waits():
    handoff = HandOff(Helper(policy(WhenFull.DROP)), capacity=2)
    started = time.monotonic()
    offered = [handoff.offer(index) for index in range(10)]  # no worker takes anything
    assert time.monotonic() - started < 1.0
    assert offered == [True, True] + [False] * 8
    assert handoff.helper.dropped == 8 and handoff.backlog == 2 and handoff.helper.is_up
    assert [handoff.take(timeout=0)[1] for _ in range(2)] == [0, 1]  # the first ones kept, in order


def test_latest_replaces_the_item_still_waiting():
    handoff = HandOff(Helper(policy(WhenFull.LATEST)), capacity=1)
    assert all(handoff.offer(name) for name in ("first", "second", "third"))
    assert handoff.take(timeout=0) == (True, "third") and handoff.take(timeout=0) == (False, None)
    assert handoff.helper.dropped == 2 and handoff.backlog == 1  # the one taken, not done yet
    handoff.done()
    assert handoff.backlog == 0


@pytest.mark.parametrize("gives", [False, True], ids=["offer", "give"])
def test_latest_with_a_grace_drops_the_oldest_only_once_the_taker_has_not_made_room_within_it(gives):
    """A live source's reader: a taker busy for less than the grace loses nothing; one that stays away, the
    oldest is dropped for the newest after the grace, never before."""
    handoff = HandOff(Helper(policy(WhenFull.LATEST, push_back_s=0.3)), capacity=1, gives=gives)
    hand = handoff.give if gives else handoff.offer
    assert hand("first")
    taker = threading.Timer(0.05, lambda: handoff.take(timeout=0))  # busy for a moment, then takes
    taker.start()
    started = time.monotonic()
    assert hand("second") and time.monotonic() - started < 0.3
    taker.join()
    assert handoff.helper.dropped == 0
    started = time.monotonic()
    assert hand("third")  # nobody takes: "second" is dropped after the grace
    assert 0.29 <= time.monotonic() - started < 2.0
    assert handoff.helper.dropped == 1 and handoff.take(timeout=0) == (True, "third")


@pytest.mark.parametrize("when_down", [WhenDown.TURN_OFF, WhenDown.FAIL_RUN])
def test_push_back_waits_at_most_push_back_s_then_the_helper_is_down(when_down, caplog):
    handoff = HandOff(Helper(policy(WhenFull.PUSH_BACK, when_down, push_back_s=0.2)), capacity=1)
    assert handoff.offer("taken by nobody")
    started = time.monotonic()
    if when_down is WhenDown.FAIL_RUN:
        with pytest.raises(HelperDown, match="^the test helper failed: it took nothing for 0.2 s$"):
            handoff.offer("waits")
    else:
        assert handoff.offer("waits") is False
    waited = time.monotonic() - started
    assert 0.2 <= waited < 2.0
    assert handoff.helper.down_reason == "it took nothing for 0.2 s" and handoff.helper.dropped == 1
    # down: the next offer returns at once (or fails the run again)
    started = time.monotonic()
    if when_down is WhenDown.FAIL_RUN:
        with pytest.raises(HelperDown):
            handoff.offer("after")
        assert warnings_of(caplog) == []  # (the run's error line says it)
    else:
        assert handoff.offer("after") is False
        assert warnings_of(caplog) == ["the test helper is off for the rest of the run: it took nothing for 0.2 s"]
    assert time.monotonic() - started < 0.1


def test_push_back_hands_over_as_soon_as_the_worker_takes():
    handoff = HandOff(Helper(policy(WhenFull.PUSH_BACK, push_back_s=10.0)), capacity=1)
    handoff.offer("first")
    waiting = threading.Event()

    def worker():
        waiting.wait(timeout=10)
        handoff.take(timeout=10)

    threading.Thread(target=worker, daemon=True).start()
    waiting.set()
    started = time.monotonic()
    assert handoff.offer("second") and time.monotonic() - started < 5.0 and handoff.helper.is_up


@pytest.mark.parametrize("when_down", [WhenDown.TURN_OFF, WhenDown.FAIL_RUN])
def test_a_helper_with_work_and_no_beat_for_stall_s_is_down(clock, when_down):
    helper = Helper(policy(when_down=when_down, stall_s=5.0))
    clock.advance(4.9)
    assert helper.check(has_work=True)
    clock.advance(0.2)
    assert helper.check(has_work=False) and helper.is_up  # idle is no stall
    helper.beat()
    clock.advance(5.1)
    if when_down is WhenDown.FAIL_RUN:
        with pytest.raises(HelperDown, match="^the test helper failed: it made no progress for 5 s$"):
            helper.check(has_work=True)
    else:
        assert helper.check(has_work=True) is False
    assert helper.record() == {"up": False, "reason": "it made no progress for 5 s", "dropped": 0,
                               "when_down": when_down.value}


def test_a_helper_idle_for_long_is_not_stalled_by_the_item_that_wakes_it(clock):
    """The stall clock runs from when the helper has work again, not from its last item long ago."""
    handoff = HandOff(Helper(policy(WhenFull.DROP, stall_s=5.0)), capacity=4)
    clock.advance(60.0)  # idle for a minute
    assert handoff.offer("first") and handoff.offer("second")  # the second sees work handed 0 s ago
    assert handoff.helper.is_up
    clock.advance(5.1)
    assert handoff.offer("third") is False and handoff.helper.down_reason == "it made no progress for 5 s"


def test_the_first_reason_stands_and_a_helper_turned_off_says_so_once(caplog):
    helper = Helper(policy())
    helper.fail("it raised OSError: disk gone")
    helper.fail("it made no progress for 5 s")
    assert helper.down_reason == "it raised OSError: disk gone" and not helper.check(has_work=True)
    assert warnings_of(caplog) == ["the test helper is off for the rest of the run: it raised OSError: disk gone"]


def test_drain_waits_for_the_backlog_until_its_deadline():
    handoff = HandOff(Helper(policy(WhenFull.DROP, stall_s=60.0)), capacity=4)
    for index in range(3):
        handoff.offer(index)
    started = time.monotonic()
    assert handoff.drain(Deadline(0.3)) is False  # nobody works: it ends at the deadline
    assert 0.3 <= time.monotonic() - started < 2.0 and handoff.helper.is_up  # (no stall within 60 s)
    release = threading.Event()

    def worker():
        release.wait(timeout=10)
        for _ in range(3):
            handoff.take(timeout=1)
            handoff.done()

    threading.Thread(target=worker, daemon=True).start()
    release.set()
    assert handoff.drain(Deadline(10.0)) is True and handoff.backlog == 0


def test_drain_of_a_helper_that_stalls_ends_it_and_marks_it_down(caplog):
    handoff = HandOff(Helper(policy(WhenFull.DROP, stall_s=0.2)), capacity=4)
    handoff.offer("never taken")
    started = time.monotonic()
    assert handoff.drain(Deadline(30.0)) is False
    assert time.monotonic() - started < 5.0  # at the stall, long before the deadline
    assert handoff.helper.down_reason == "it made no progress for 0.2 s"
    assert warnings_of(caplog) == ["the test helper is off for the rest of the run: it made no progress for 0.2 s"]


def test_drain_returns_at_once_when_the_deadline_has_passed():
    handoff = HandOff(Helper(policy(WhenFull.DROP)), capacity=1)
    handoff.offer("pending")
    started = time.monotonic()
    assert handoff.drain(Deadline(0.0)) is False and time.monotonic() - started < 0.1


@pytest.mark.parametrize("when_down", [WhenDown.TURN_OFF, WhenDown.FAIL_RUN])
def test_a_supervised_thread_that_raises_marks_its_helper_down_with_the_error(when_down, caplog):
    helper = Helper(policy(when_down=when_down))

    def write():
        raise OSError("no space left on device")

    thread = start_supervised_thread(helper, write, "test-writer")
    thread.join(timeout=10)
    assert not thread.is_alive() and thread.daemon and thread.name == "test-writer"
    assert helper.down_reason == "OSError: no space left on device"
    if when_down is WhenDown.FAIL_RUN:
        with pytest.raises(HelperDown, match="^the test helper failed: OSError: no space left on device$"):
            helper.check(has_work=False)
    else:
        assert warnings_of(caplog) == ["the test helper is off for the rest of the run: OSError: no space left on "
                                       "device"]


def test_a_deadline_counts_down_to_zero_and_never_below(clock):
    deadline = Deadline(2.0)
    assert deadline.remaining() == 2.0 and not deadline.expired
    clock.advance(1.5)
    assert deadline.remaining() == pytest.approx(0.5)
    clock.advance(1.0)
    assert deadline.remaining() == 0.0 and deadline.expired and deadline.seconds == 2.0


def test_close_wakes_a_waiting_take_at_once_after_the_items_left():
    handoff = HandOff(Helper(policy(WhenFull.DROP)), capacity=4)
    handoff.offer("left over")
    handoff.close()
    assert handoff.offer("too late") is False and not handoff.closed  # one item is still to be taken
    assert handoff.take(timeout=0) == (True, "left over") and handoff.closed
    handoff.done()
    taken = []
    worker = threading.Thread(target=lambda: taken.append(handoff.take(timeout=60)), daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and taken == [(False, None)] and time.monotonic() - started < 5.0


def test_close_wakes_a_take_that_is_already_waiting_and_an_offer_waiting_for_room():
    handoff = HandOff(Helper(policy(WhenFull.PUSH_BACK, push_back_s=60.0)), capacity=1)
    waiting_take = threading.Thread(target=handoff.take, args=(60.0,), daemon=True)
    waiting_take.start()
    wait_until(lambda: handoff._changed._waiters)  # the worker waits in take
    handoff.close()
    waiting_take.join(timeout=10)
    assert not waiting_take.is_alive()
    reopened = HandOff(Helper(policy(WhenFull.PUSH_BACK, push_back_s=60.0)), capacity=1)
    reopened.offer("fills it")
    offers = []
    waiting_offer = threading.Thread(target=lambda: offers.append(reopened.offer("waits")), daemon=True)
    waiting_offer.start()
    wait_until(lambda: reopened.backlog == 2)  # the second offer waits for room
    reopened.close()
    waiting_offer.join(timeout=10)
    assert not waiting_offer.is_alive() and offers == [False] and reopened.backlog == 1
