"""The end of the loop-closure child: its last word ("finished") and its exit are one event, however late
the stream's side reads them."""

from __future__ import annotations

import pytest

pytest.importorskip("gtsam")

from stream_recon.models.loops.closer import LoopClosureConfig  # noqa: E402
from stream_recon.models.loops.process import LoopClosureProcess  # noqa: E402
from stream_recon.models.supervision import Deadline  # noqa: E402


@pytest.mark.slow
def test_a_child_read_only_after_its_last_word_and_its_exit_has_finished_and_not_failed(monkeypatch) -> None:
    """On a loaded machine the stream's thread can be descheduled while the child answers `finish` and
    exits: one read then returns the last word and the end of the pipe. That is the run's normal end."""

    def read_late(self: LoopClosureProcess, timeout: float) -> None:
        self._child.process.wait(timeout=60.0)  # the child has said everything and exited before the read

    monkeypatch.setattr(LoopClosureProcess, "_wait_for_pipes", read_late)
    closer = LoopClosureProcess(LoopClosureConfig())
    try:
        corrections = closer.finish(Deadline(60.0))
    finally:
        closer.close()
    assert closer.helper.is_up, closer.helper.down_reason
    assert closer._child.process.returncode == 0
    assert corrections.is_identity and closer.summary()["keyframes_indexed"] == 0
