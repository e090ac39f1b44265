"""StageClock and StageMarks: one forward's marks by name, bounding the traced stages."""

from __future__ import annotations

import torch

from capability.model.stages import MARKS, STAGES, StageClock


def test_marks_made_in_order_bound_each_stage_in_turn() -> None:
    clock = StageClock(torch.device("cpu"))
    for name in MARKS:
        clock.mark(name)
    marks = clock.marks()
    assert marks is not None
    stages = marks.stages()
    assert tuple(stage for stage, _, _ in stages) == STAGES
    assert all(start <= end for _, start, end in stages)
    assert (stages[0][1], stages[-1][2]) == (marks.started, marks.done)


def test_forward_missing_a_mark_has_no_stage_marks() -> None:
    clock = StageClock(torch.device("cpu"))
    for name in MARKS[:-1]:
        clock.mark(name)
    assert clock.marks() is None
