"""Which keyframes loop detection indexes (models/loops/coverage.py): a spacing rule that the queue to the
loop closer never overrides, lowered evenly when detection cannot keep up."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.models.loops.coverage import IndexingRule, IndexingSchedule


def test_with_room_everywhere_every_spacing_th_frame_is_indexed() -> None:
    schedule = IndexingSchedule(IndexingRule(spacing=4, max_spacing=16))
    indexed = [frame for frame in range(30) if schedule.offer(frame, has_room=True)]
    assert indexed == [0, 4, 8, 12, 16, 20, 24, 28]
    assert schedule.summary() == {"index_spacing": {"start": 4, "end": 4}, "indexed_per_100_frames": pytest.approx(
        100 * 8 / 30, abs=1e-3), "longest_unindexed_stretch": 3, "keyframes_deferred": 0}


def test_a_due_keyframe_without_room_doubles_the_spacing_from_the_last_indexed_one() -> None:
    # frame    0 . . . 4 . . . 8 . . . 12 . . . . . . . 20 . . . . . . . 28
    # indexed  x       x       -       x                x                x
    schedule = IndexingSchedule(IndexingRule(spacing=4, max_spacing=16))
    indexed = [frame for frame in range(30) if schedule.offer(frame, has_room=frame != 8)]
    assert indexed == [0, 4, 12, 20, 28]
    assert schedule.spacing == 8 and schedule.lowerings == 1 and schedule.deferred == 1
    assert schedule.longest_unindexed_stretch == 7


def test_a_loop_closer_still_starting_defers_keyframes_without_lowering_the_density() -> None:
    schedule = IndexingSchedule(IndexingRule(spacing=4, max_spacing=16))
    indexed = [frame for frame in range(20) if schedule.offer(frame, has_room=frame not in (4, 5), may_lower=False)]
    assert indexed == [0, 6, 10, 14, 18]
    assert schedule.spacing == 4 and schedule.deferred == 2


def test_the_spacing_doubles_at_most_once_per_indexed_keyframe_and_stops_at_its_most() -> None:
    schedule = IndexingSchedule(IndexingRule(spacing=4, max_spacing=8))
    for frame in range(4, 40):  # never room after frame 0
        schedule.offer(frame - 4, has_room=frame == 4)
    assert schedule.spacing == 8 and schedule.lowerings == 1


def test_the_rule_refuses_a_spacing_beyond_its_most() -> None:
    with pytest.raises(ValueError, match="between 1 and max_spacing"):
        IndexingRule(spacing=32, max_spacing=16)


@st.composite
def keyframe_streams(draw):
    """Keyframes 1-6 frames apart (flow keyframes), each with or without room, the closer ready or not."""
    steps = draw(st.lists(st.integers(1, 6), min_size=1, max_size=120))
    room = draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    ready = draw(st.lists(st.booleans(), min_size=len(steps), max_size=len(steps)))
    frames = [sum(steps[: i + 1]) for i in range(len(steps))]
    return frames, room, ready, draw(st.integers(0, 3))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(keyframe_streams(), st.integers(1, 8))
def test_every_due_keyframe_with_room_is_indexed_and_nothing_else(stream, spacing) -> None:
    frames, room, ready, trailing = stream
    rule = IndexingRule(spacing, 4 * spacing)
    schedule = IndexingSchedule(rule)
    schedule.saw_frame(0)
    indexed: list[int] = []
    lowered_since_indexed = False
    for frame, has_room, may_lower in zip(frames, room, ready, strict=True):
        spacing_before = schedule.spacing
        due = not indexed or frame >= indexed[-1] + spacing_before
        assert schedule.offer(frame, has_room, may_lower) == (due and has_room)
        if due and has_room:
            indexed.append(frame)
            lowered_since_indexed = False
        if schedule.spacing != spacing_before:  # lowered: only by a due keyframe without room, once, evenly
            assert due and not has_room and may_lower and not lowered_since_indexed
            assert schedule.spacing == min(2 * spacing_before, rule.max_spacing)
            lowered_since_indexed = True
    schedule.saw_frame(frames[-1] + trailing)
    seen = range(0, frames[-1] + trailing + 1)
    assert schedule.longest_unindexed_stretch == longest_run_without(set(indexed), seen)
    assert schedule.indexed == len(indexed)
    assert schedule.summary()["indexed_per_100_frames"] == pytest.approx(100 * len(indexed) / len(seen), abs=1e-3)


def longest_run_without(indexed: set[int], frames: range) -> int:
    longest = run = 0
    for frame in frames:
        run = 0 if frame in indexed else run + 1
        longest = max(longest, run)
    return longest


def drive_against_a_slow_closer(frames: int, detection_frames: int, rule: IndexingRule,
                                in_flight: int = 8) -> tuple[IndexingSchedule, list[int]]:
    """Keyframes at every frame (`--keyframes all`) offered to a loop closer that answers one keyframe every
    `detection_frames` frames, with `in_flight` unanswered at most, as LoopClosureProcess counts them."""
    schedule = IndexingSchedule(rule)
    unanswered: deque[int] = deque()  # the frame each unanswered keyframe's detection ends at
    indexed = []
    for frame in range(frames):
        while unanswered and unanswered[0] <= frame:
            unanswered.popleft()
        if schedule.offer(frame, has_room=len(unanswered) < in_flight):
            start = max(frame, unanswered[-1]) if unanswered else frame
            unanswered.append(start + detection_frames)
            indexed.append(frame)
    return schedule, indexed


def test_against_a_slow_closer_no_stretch_of_100_frames_lacks_an_indexed_keyframe() -> None:
    # detection takes 20 frames' time a keyframe: slower than one keyframe every 16 frames, not than every 32
    schedule, indexed = drive_against_a_slow_closer(3000, detection_frames=20, rule=IndexingRule(16, 64))
    assert schedule.longest_unindexed_stretch < 100
    assert schedule.spacing == 32 and schedule.lowerings == 1
    gaps = [b - a for a, b in zip(indexed, indexed[1:], strict=False)]
    # even: 16 until the backlog of 8 fills, then 32 frames apart to the end
    lowered_at = gaps.index(32)
    assert set(gaps[:lowered_at]) == {16} and set(gaps[lowered_at:]) == {32}


def test_against_a_closer_too_slow_for_the_most_spacing_the_stretches_stay_even() -> None:
    # detection takes 90 frames' time a keyframe: even one every 64 frames falls behind
    detection_frames = 90
    schedule, indexed = drive_against_a_slow_closer(3000, detection_frames, rule=IndexingRule(16, 64))
    assert schedule.spacing == 64 and schedule.lowerings == 2
    gaps = [b - a for a, b in zip(indexed, indexed[1:], strict=False)]
    # a due keyframe waits for one answer at most: no gap is longer than one detection's time, and once
    # the backlog is full the closer's own pace sets every gap
    assert max(gaps) == detection_frames and set(gaps[-10:]) == {detection_frames}
    assert schedule.longest_unindexed_stretch == detection_frames - 1
