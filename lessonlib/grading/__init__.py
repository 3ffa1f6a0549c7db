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

**How a submission is graded.** The grader refuses to start where no sandbox can (:mod:`~lessonlib.grading.sandbox`:
bubblewrap, else unprivileged user namespaces; ``--unsafe-no-sandbox`` grades anyway, one notebook at a time, with a
warning), and where the course differs from its release (:mod:`~lessonlib.grading.release`: the git commit or the
install manifest; lessonlib's files, bytecode, ``sitecustomize.py`` and ``*.pth`` files). A sandbox sees read-only the
system's libraries, the Python environment and a pristine copy of lessonlib written by the grader, and nothing else of
the host (no notebooks, submissions, grades, home folder, host sockets); a working folder (also ``HOME``,
``TMPDIR``; ``/tmp`` and ``/dev/shm`` too) that is a tmpfs of ``--scratch-mb``; no network, a PID namespace that dies
with the run (and stops it past 512 processes), a limit on one file's size, an allowlisted environment, no bytecode
written. Only regular files are read from a student's folder (``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``).

1. *The kernel* (nbclient, for the feedback and the ``graded/`` copy) runs the student's cells in order, with a time
   limit per cell and per notebook and a cap on every byte of output kept per cell (text, MIME bundles, display
   metadata, error names); each checker cell is replaced by a stand-in that prints a random token. Lesson cells
   after the last checker are not run.
2. *The runner* (:mod:`~lessonlib.grading.judge`), a plain ``python`` in a sandbox of its own, runs the student's
   set-up cells, each solution cell and the imports and function definitions of the other cells, and at each check
   answers the judge's calls of the student's functions with plain data (:mod:`~lessonlib.grading.wire`).
3. *The validated runner* (:mod:`~lessonlib.grading.validated`), a process of its own (a fork of the judge, in the
   judge's sandbox, made before the judge runs any check; on a GPU a fresh interpreter there), runs lessonlib's checker
   on answers that are source text taken from the notebook with :mod:`ast` and validated, and on nothing else of the
   submission: a kernel exercise's ``@triton.jit`` function, Triton language only
   (:mod:`~lessonlib.grading.kernel_source`), and the function of a checker that must run it in its own process
   (:data:`judge.IN_PROCESS`: lesson 04's ``torch.compile``, lesson 05's CUDA graph and tensor addresses), in a small
   PyTorch subset (:mod:`~lessonlib.grading.torch_source`). An answer outside these gets 0 with the reason.
4. *The judge*, another sandboxed ``python`` that runs no code that came from the submission, runs each pristine checker
   with the student's function replaced by a stand-in for the runner, and reads each validated check's outcome from the
   validated runner as plain data.

An exercise gets its points when its check passed in the judge and the kernel reached its cell; its message is the
checker's last message, its wrapped lines joined (or its error's first line), cut to 300 characters. After each
notebook the course is compared with the start: a change is put back, and the notebooks graded meanwhile get 0 and a
FLAGGED note. Only the grader writes ``grades.csv``, once every sandbox (and so every process a notebook started) is
gone.

**Defended, each by a test** (``tests/test_grading.py``, ``tests/test_grading_sandbox.py``,
``tests/test_grading_adversarial.py``, ``tests/test_grading_judge.py``, ``tests/test_grading_fakes.py``): edited,
deleted or redefined checkers; patched ``lessonlib`` and ``torch``; fake modules; walking the stack or ``gc`` to the
grader's state; spoofed classes, fake kernel objects (look-alikes, subclasses of Triton's kernel class, a patched
``triton.jit``, wrappers that overwrite the output or launch on copies: issue 41's, in every kernel exercise),
always-equal objects; a lesson-04 answer outside the PyTorch subset (a stack walker, a forger of the validated
runner's outcome); an IPython input transformer; reading the instructor's notebook, a secret
beside the course, ``/etc/hostname``; a symbolic link or FIFO in the submission; a Unix socket on the host;
bytecode or ``sitecustomize.py`` written into the checkout; a checkout or Python under ``/tmp``; a detached process
rewriting ``grades.csv``; the network; floods of output, display metadata or error names; a fork bomb; a full working
folder; hangs, crashes, broken JSON; two files for one lesson.

**Not defended:** a kernel exploit or a bug in bubblewrap or the kernel's namespaces; memory (no limit: a notebook
that allocates without end is stopped by the machine's OOM killer); what a validated answer can reach beside the
checker in the validated runner (the tensors it is given, the public torch or Triton functions the subsets allow:
not the checker's frames, modules or result channel), and, were an answer to escape its subset, the judge's sandbox,
which the validated runner shares (the judge is non-dumpable: not traced nor read by a process of its user); a
Triton kernel's own behaviour beyond what its checker observes (issue 41's checkers certify the launch); a solution
that calls ``lessonlib.reference`` or ``lessonlib.ops`` (the instructor reads the code in ``graded/``); the grader's
own modules, imported before the release check runs. Without a sandbox (``--unsafe-no-sandbox``), a notebook can
also write any file the grader's user can (the course is put back; ``grades.csv`` and the rest are not), start
processes that outlive it and reach the network.

The package, one module per job: :mod:`~lessonlib.grading.exercise_format` (the format, student copies, nbgrader's
configuration), :mod:`~lessonlib.grading.kernel_side` (the plan's first cell and its checker cells),
:mod:`~lessonlib.grading.scoring` (which cells the runner runs), :mod:`~lessonlib.grading.judge` (the judge and the
runner, and starting them) with :mod:`~lessonlib.grading.wire` (their channel),
:mod:`~lessonlib.grading.validated` (the validated runner), :mod:`~lessonlib.grading.kernel_source` and
:mod:`~lessonlib.grading.torch_source` (an answer's validated source), :mod:`~lessonlib.grading.release` (the course
as released),
:mod:`~lessonlib.grading.sandbox` (the sandboxes, capped raw output) with :mod:`~lessonlib.grading.sandbox_init`
(their init: mounts, the process watch), :mod:`~lessonlib.grading.notebook_run` (one notebook: plan, run, outcomes)
and :mod:`~lessonlib.grading.submissions` (a folder of submissions, the command line). Every name is re-exported
here.
"""

import importlib

# Every name is re-exported here, each imported on first use (PEP 562): the judge and the runners, plain pythons
# that import lessonlib.grading's modules, then load neither nbformat nor nbclient. (nbformat validates notebooks with
# jsonschema, whose import builds rfc3987-syntax's ~35 Earley parsers: 3.7 s of CPU per process on CI's machine.)
_HOME = {
    "exercise_format": ("BEGIN", "END", "Exercise", "configure_nbgrader", "exercises", "lock", "strip_solutions",
                        "student_copy"),
    "kernel_side": ("PRELUDE", "checker_cell"),
    "notebook_run": ("ROOT", "Limits", "NotebookReport", "Outcome", "grade_notebook", "plan"),
    "release": ("Course",),
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
