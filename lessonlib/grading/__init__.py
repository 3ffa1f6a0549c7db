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

**How a submission is graded.** Each notebook runs twice, at once, each run in a sandbox of its own
(:mod:`~lessonlib.grading.sandbox`: bubblewrap, else unprivileged user namespaces, else none, with a warning;
``--require-sandbox`` refuses to go on without one). Inside: the whole file system read-only, the submissions, ``--out``
and every other notebook's scratch hidden, a working folder (also ``HOME``, ``TMPDIR``; ``/tmp`` and ``/dev/shm``
too) that is a tmpfs of ``--scratch-mb``, no network, a PID namespace that dies with the run (and stops it past 512
processes), a limit on one file's size, and an allowlisted environment (none of the grader's other variables).

1. *The kernel* (nbclient, for the feedback and the ``graded/`` copy) runs the student's cells in order, with a time
   limit per cell and per notebook and a cap on the output kept per cell; each checker cell (by its nbgrader
   metadata, or a cell that is nothing but a checker call, or, deleted, right after the student's solution cell) is
   replaced by a stand-in that prints a random token. Lesson cells after the last checker are not run.
2. *The scoring process* (:mod:`~lessonlib.grading.scoring`), a plain ``python`` with no IPython, runs the student's
   set-up cells, each solution cell and only the imports and function definitions of the other cells, then the
   instructor's pristine checker for each exercise, with lessonlib's checking modules imported fresh from disk. Before
   each check it looks for tampering: a function of ``lessonlib``, of ``torch`` (``torch``, ``torch.Tensor``,
   ``torch.nn.functional``, ``torch.testing``, ``torch.linalg``), of ``builtins``, ``math`` or ``random``, or an
   import hook, replaced by code that is not an installed library's (a lambda or ``def`` from a notebook cell, an
   object of a class defined there, a fake module in ``sys.modules``), or one of the grader's own helpers replaced.
   Tampering gives no points for every exercise checked after it, and the feedback names what was replaced. Each
   check's outcome goes to the grader on a pipe of its own, tagged with a nonce the student's code never sees.

An exercise gets its points when its pristine check passed in the scoring process and the kernel reached its cell;
its message is the checker's last line (or its error). A stand-in cell that did not print its token (an IPython
input transformer rewrote it) is named in the feedback. A notebook that hangs (interrupted at the cell limit;
killed when it stays busy), kills its kernel, raises, prints megabytes (cut at the cap; the kernel's raw stdout and
stderr go to ``graded/<student>/<lesson>.kernel.txt``, capped too), forks without end, fills its folder, is not valid
JSON or has lost cells is graded for what ran, with the reason in the feedback; the other notebooks and students
are graded as usual. Two files for one lesson: the one named exactly as the course names it is graded, and the
feedback says which was not. The grader hashes lessonlib and the instructor notebooks before the first notebook and
after each: a change stops the grading, naming the notebook, with no ``grades.csv``. Only the grader writes
``grades.csv``, once every sandbox (and so every process a notebook started) is gone.

**Defended, each by a test** (``tests/test_grading.py``, ``tests/test_grading_sandbox.py``): edited, deleted or
redefined checkers; patched ``lessonlib`` and ``torch``; a fake module in ``sys.modules``; an IPython
input transformer (points come from the plain Python); a replaced grader helper; writes into ``lessonlib/``, by
absolute path, by ``../`` (they fail or land in the sandbox's own tmpfs); a detached process
(``start_new_session=True``: it dies with the PID namespace, before ``grades.csv`` is written); reading the
grader's environment; the network; ``os.write(1, ...)`` floods; a fork bomb; a full working folder; hangs, crashes,
broken JSON; two files for one lesson.

**Not defended** (the threat is a student who wants points without solving the exercise, not a hardened
attacker of the machine): in the scoring process, code that finds the grader's own state in memory (the nonce, the
pipe, the snapshot, through ``gc`` or frames) or rewrites code objects, and patches with a C function or a function of
an installed library (``torch.allclose = torch.equal``: library code is trusted, so that libraries may wrap
torch's functions); patches of modules other than those listed; a kernel exploit or a bug in bubblewrap or the kernel's
namespaces; reading files that the grader's user can read outside the hidden folders (the sandbox hides the
submissions, ``--out`` and the scratch folders, not the rest of the file system); filling the kernel's socket
folder on the host disk (the one host folder a sandbox can write, each file capped by ``RLIMIT_FSIZE``); memory (no
limit: a notebook that allocates without end is stopped by the machine's OOM killer); a solution that calls
``lessonlib.reference`` or ``lessonlib.ops`` (not tampering: the instructor reads the code in ``graded/``). Without a
sandbox (``none``: the grader says so when it starts), a notebook can also write any file the grader's user can
(the checkout: the hash check then stops the grading; ``grades.csv``), start processes that outlive it, and reach
the network: grade untrusted work with bubblewrap installed, or in a container.

The package, one module per job: :mod:`~lessonlib.grading.exercise_format` (the format, student copies, nbgrader's
configuration), :mod:`~lessonlib.grading.kernel_side` (the prelude and the pristine checker cell, run inside the
scoring process), :mod:`~lessonlib.grading.scoring` (the scoring process, and starting and reading it),
:mod:`~lessonlib.grading.sandbox` (the sandboxes, capped raw output) with :mod:`~lessonlib.grading.sandbox_init`
(their init: mounts, the process watch), :mod:`~lessonlib.grading.notebook_run` (one notebook: plan, run, outcomes)
and :mod:`~lessonlib.grading.submissions` (a folder of submissions, the command line). Every name is re-exported
here.
"""

import importlib

# Every name is re-exported here, each imported on first use (PEP 562): the scoring process, a plain python that
# imports lessonlib.grading.scoring, then loads neither nbformat nor nbclient. (nbformat validates notebooks with
# jsonschema, whose import builds rfc3987-syntax's ~35 Earley parsers: 3.7 s of CPU per process on CI's machine.)
_HOME = {
    "exercise_format": ("BEGIN", "END", "Exercise", "configure_nbgrader", "exercises", "lock", "strip_solutions",
                        "student_copy"),
    "kernel_side": ("KERNEL_SIDE", "PRELUDE", "checker_cell"),
    "notebook_run": ("ROOT", "Limits", "NotebookReport", "Outcome", "grade_notebook", "plan"),
    "sandbox": ("Box", "SandboxUnavailable"),
    "scoring": ("apart",),
    "submissions": ("COURSE_NOTEBOOKS", "CourseChanged", "course_exercises", "course_hash", "grade", "main"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = sorted(_MODULE_OF)
