"""Run the course notebooks (the lessons, then the appendix of measured results) top to bottom in a fresh kernel and
store their outputs (what readers see on GitHub, and what nbval compares in cells marked NBVAL_CHECK_OUTPUT).

    python tools/execute_notebooks.py [notebooks/01_operator_fusion.ipynb ...]
    python tools/execute_notebooks.py --setup-only [...]   # only the set-up cell (what `make relink` rewrites)
"""

import argparse
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def execute(notebook, path: Path) -> None:
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--setup-only", action="store_true",
                        help="run only the first code cell in a fresh kernel and store its output; leave the rest")
    args = parser.parse_args(argv)
    lessons = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for path in args.paths or lessons + [ROOT / "notebooks" / "appendix_measurements.ipynb"]:
        start = time.time()
        notebook = nbformat.read(path, as_version=4)
        if args.setup_only:
            index = next(i for i, cell in enumerate(notebook.cells) if cell.cell_type == "code")
            head = nbformat.from_dict({**notebook, "cells": notebook.cells[: index + 1]})
            execute(head, path)
            setup = notebook.cells[index]
            setup.outputs, setup.execution_count = head.cells[index].outputs, head.cells[index].execution_count
            setup.metadata = head.cells[index].metadata
        else:
            execute(notebook, path)
        nbformat.write(notebook, path)
        print(f"executed {path.name}{' (set-up cell)' if args.setup_only else ''} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
