"""The grader's own cells in a plan of a notebook (:func:`~lessonlib.grading.notebook_run.plan`): the first cell, and
the pristine checker cell put where each check runs. Neither runs beside the student's code: the kernel runs a
stand-in for each check, and the checks run in the judge and the validated runner
(:mod:`~lessonlib.grading.judge`), from the exercise's checker source.

(Before issue 43 the first cell was a prelude that snapshotted what the checks rely on, in a scoring process that
ran the checkers beside the student's code.)
"""

from __future__ import annotations

from lessonlib.grading.exercise_format import Exercise

PRELUDE = "# lessonlib.grading: the plan's first cell (the student's cells follow; the checks run apart)\n"


def checker_cell(exercise: Exercise) -> str:
    return (f"# lessonlib.grading: the instructor's checker for {exercise.name}, run apart from the student's code\n"
            f"{exercise.checker_source}")
