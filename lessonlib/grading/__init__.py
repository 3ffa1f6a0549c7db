"""Grade the course's exercises: the exercise format, student copies, nbgrader, and a grader with no server.

    python -m lessonlib.grading SUBMISSIONS [--out DIR]      # or: make grade SUBMISSIONS=folder

``SUBMISSIONS`` holds one folder per student (its name is the student's id) with that student's notebooks anywhere
inside it, named as the course names them (``03_paged_attention.ipynb``; a download suffix such as
``03_paged_attention (1).ipynb`` is fine: the two-digit prefix picks the lesson). nbgrader's ``submitted/`` folder
has that layout. The grader writes ``grades.csv`` (one row per student, one column per exercise, then the total),
``feedback/<student>.txt`` (each checker's message) and ``graded/<student>/<notebook>`` (the notebook as it ran).

**The exercise format.** In an instructor notebook an exercise is a solution cell (its answer between
``### BEGIN SOLUTION`` and ``### END SOLUTION``) and, below it, a checker cell ``check_x(my_x)`` calling
:mod:`lessonlib.exercises`. Both carry nbgrader's cell metadata (``metadata.nbgrader``: ``solution``, ``grade``,
``points``, ``grade_id``, ``locked``), which is the one place points are written. :func:`student_copy` strips the
solutions as nbgrader's ``generate_assignment`` does (:func:`configure_nbgrader` makes nbgrader use the same stub).

**How a submission is graded.** Each notebook runs headless in a fresh kernel (nbclient) whose working directory,
``HOME`` and ``TMPDIR`` are a scratch folder of the grader's, with a time limit per cell and per notebook and a
cap on the output kept per cell. The student's cells run in their order, except checker cells: every cell that is one
(by its nbgrader metadata) or is nothing but a checker call is replaced by the instructor's pristine checker, which
also runs right after the student's solution cell when the checker cell was deleted. Lesson cells after the last
checker are not run: they cannot change a grade. The pristine checker runs with ``lessonlib``'s checking modules
imported fresh from disk (the student's imported copies are set aside, then put back), so a checker cell that was
edited or deleted, a ``check_x`` redefined in the notebook, or a patched ``lessonlib.exercises`` or
``lessonlib.testing`` changes nothing. Before each check the grader also looks for tampering: a function of
``lessonlib``, of ``torch`` (``torch``, ``torch.Tensor``, ``torch.nn.functional``, ``torch.testing``,
``torch.linalg``), of ``builtins``, ``math`` or ``random``, or an import hook, replaced since the kernel started by
code that is not an installed library's (a lambda or ``def`` from a notebook cell, an object of a class defined
there, a fake module in ``sys.modules``). Tampering gives no points for every exercise checked after it, and the
feedback names what was replaced. An exercise gets its points when its pristine checker cell finishes without an
error; its message is the checker's last line (or its error). A notebook that hangs (interrupted at the cell limit;
killed when it stays busy), kills its kernel, raises, prints megabytes (cut at the cap), is not valid JSON or has
lost cells is graded for what ran, with the reason in the feedback; the other notebooks and students are graded as
usual.

**Not defended** (the threat is a student who wants a check to pass without solving the exercise, by editing or
shadowing checks or by patching what they call; not an attack on the grader itself, which runs in the same Python
process as the student's code): code that finds the grader's own functions in the kernel and edits them or their
snapshot, rewrites frames or code objects, or patches with a C function or a function of an installed library
(``torch.allclose = torch.equal``: library code is trusted, so that libraries may wrap torch's functions);
patches of modules other than those listed; files written by absolute path outside the scratch folder (grade
untrusted work in a container or as a separate user); a solution that calls ``lessonlib.reference`` or
``lessonlib.ops`` (not tampering: the instructor reads the code in ``graded/``).

The package, one module per job: :mod:`~lessonlib.grading.exercise_format` (the format, student copies, nbgrader's
configuration), :mod:`~lessonlib.grading.kernel_side` (the prelude and the pristine checker cell, run inside the
student's kernel), :mod:`~lessonlib.grading.notebook_run` (one notebook: plan, run, outcomes) and
:mod:`~lessonlib.grading.submissions` (a folder of submissions, the command line). Every name is re-exported here.
"""

from lessonlib.grading.exercise_format import (BEGIN, END, Exercise, configure_nbgrader, exercises, lock,
                                               strip_solutions, student_copy)
from lessonlib.grading.kernel_side import KERNEL_SIDE, PRELUDE, checker_cell
from lessonlib.grading.notebook_run import ROOT, Limits, NotebookReport, Outcome, grade_notebook, plan
from lessonlib.grading.submissions import COURSE_NOTEBOOKS, course_exercises, grade, main

__all__ = ["BEGIN", "COURSE_NOTEBOOKS", "END", "Exercise", "KERNEL_SIDE", "Limits", "NotebookReport", "Outcome",
           "PRELUDE", "ROOT", "checker_cell", "configure_nbgrader", "course_exercises", "exercises", "grade",
           "grade_notebook", "lock", "main", "plan", "strip_solutions", "student_copy"]
