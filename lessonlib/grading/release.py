"""The course as it was released, and what a graded submission must not change: ``lessonlib/`` as the checkout's git
commit has it (or, without git, as the manifest written at install lists it, :func:`write_manifest`), the instructor
notebooks, and the files that Python runs before any import (``sitecustomize.py``, ``usercustomize.py``, ``*.pth``).

:class:`Course` is read once when the grader starts: anything that differs from the release (a changed or added file
in ``lessonlib/``, a ``.pyc`` that is not the compiled source beside it, a ``.py`` or ``.pth`` in the checkout's root
that is not released, a ``sitecustomize.py`` or a ``.pth`` in the Python environment that no installed package lists and
the environment record does not hold as it is) stops the grader before any submission runs. The sandboxes see a pristine copy of lessonlib written from it
(:meth:`Course.pristine`), never the checkout. After each submission :meth:`Course.repair` compares everything again
and puts back what changed (a changed file rewritten, a new one removed), so the next submission, and the
instructor's next run, see the release.

The environment record (:func:`write_environment`, written by ``python -m lessonlib.grading.release`` at install) holds
the start-up files the environment had then that no package lists: virtualenv's ``_virtualenv.pth``, a platform's own.
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.util
import json
import marshal
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

MANIFEST = ".lessonlib-release.json"  # in the checkout's root, written at install where there is no git
ENVIRONMENT = "lessonlib-environment.json"  # in the Python environment's folder (sys.prefix): see write_environment
SHADOWING = re.compile(r"^(sitecustomize|usercustomize)(\..*)?\.py[c]?$|\.pth$")
ROOT_MODULE = re.compile(r"\.(py|pyc|pth|so)$")  # a file in the checkout's root that Python could import


class CourseChanged(RuntimeError):
    """The course differs from its release: the grader does not start, or a submission changed it."""


def _git(root: Path, *args: str) -> bytes | None:
    if not (root / ".git").exists() or shutil.which("git") is None:
        return None
    result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=60)
    return result.stdout if result.returncode == 0 else None


def released(root: Path) -> tuple[str, dict[str, bytes | str]]:
    """(where the release comes from, {path relative to ``root``: its bytes (git) or sha256 (manifest)}) for
    ``lessonlib/`` and the checkout's top-level files."""
    listing = _git(root, "ls-tree", "-r", "-z", "HEAD", "--", "lessonlib")
    top = _git(root, "ls-tree", "-z", "--name-only", "HEAD")
    if listing is not None and top is not None:
        commit = (_git(root, "rev-parse", "HEAD") or b"?").decode().strip()
        entries = [line.split(b"\t", 1) for line in listing.split(b"\0") if line]
        blobs = {path.decode(): meta.split()[2].decode() for meta, path in entries if meta.split()[1] == b"blob"}
        batch = subprocess.run(["git", "-C", str(root), "cat-file", "--batch"], input="\n".join(blobs.values())
                               .encode() + b"\n", capture_output=True, timeout=120, check=True).stdout
        files: dict[str, bytes | str] = {}
        at = 0
        for path in blobs:
            header_end = batch.index(b"\n", at)
            size = int(batch[at:header_end].split()[2])
            files[path] = batch[header_end + 1: header_end + 1 + size]
            at = header_end + 2 + size
        files.update({name.decode(): "" for name in top.split(b"\0") if name and "/" not in name.decode()
                      and name.decode() not in files})
        return f"git commit {commit[:12]}", files
    manifest = root / MANIFEST
    if manifest.is_file():
        return f"the install manifest {MANIFEST}", json.loads(manifest.read_text())
    raise CourseChanged(f"{root} is neither a git checkout nor has a release manifest ({MANIFEST}): nothing to check "
                        "the course against (python -m lessonlib.grading.release writes one)")


def write_manifest(root: Path) -> Path:
    """The manifest of an install without git: sha256 of every file of lessonlib/ (bytecode aside) and the names of
    the checkout's top-level files (tools/setup.sh writes it)."""
    files = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted((root / "lessonlib").rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    files.update({p.name: "" for p in root.iterdir() if p.name not in files and not p.name.startswith(".")})
    (root / MANIFEST).write_text(json.dumps(files, indent=0, sort_keys=True))
    return root / MANIFEST


def _startup_files() -> dict[str, bytes | str]:
    """The files of the Python environment that run before any import: ``*.pth``, ``sitecustomize``,
    ``usercustomize`` (and their bytecode), by path."""
    found: dict[str, bytes | str] = {}
    for folder in site_folders():
        for path in list(folder.iterdir()) + list((folder / "__pycache__").glob("*customize*")):
            if SHADOWING.search(path.name):
                found[str(path)] = _read(path)
    return found


def _digest(data: bytes | str) -> str:
    return hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()


def write_environment() -> Path:
    """The environment record, in the environment's own folder: sha256 of each of its start-up files that no installed
    package lists, as they are now (at install, before any submission ran; a sandbox mounts that folder read-only)."""
    listed = _recorded_pth()
    files = {path: _digest(data) for path, data in _startup_files().items() if path not in listed}
    record = Path(sys.prefix) / ENVIRONMENT
    record.write_text(json.dumps(files, indent=0, sort_keys=True))
    return record


def _environment_record() -> dict[str, str]:
    try:
        return json.loads((Path(sys.prefix) / ENVIRONMENT).read_text())
    except (OSError, ValueError):
        return {}


def site_folders() -> list[Path]:
    """Where Python looks for ``*.pth`` files and ``sitecustomize``: the venv's and the base interpreter's."""
    names = ("purelib", "platlib", "stdlib", "platstdlib")
    found = [sysconfig.get_paths()[n] for n in names]
    found += [sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})[n] for n in names]
    on_path = {os.path.realpath(p) for p in sys.path if p}
    return [Path(p) for p in dict.fromkeys(found) if os.path.isdir(p) and os.path.realpath(p) in on_path]


def _recorded_pth() -> set[str]:
    """The ``.pth`` files that installed packages list in their RECORD (editable installs, coverage, setuptools)."""
    from importlib import metadata

    found = set()
    for dist in metadata.distributions():
        for file in dist.files or ():
            if str(file).endswith(".pth") and "/" not in str(file):
                found.add(str(dist.locate_file(file)))
    return found


def _read(path: Path) -> bytes | str:
    """A file's bytes; a symbolic link as "link:target" (never followed); a folder or other file as its kind."""
    if path.is_symlink():
        return f"link:{os.readlink(path)}"
    if not path.is_file():
        return "not a regular file"
    return path.read_bytes()


class Course:
    """The files a submission must not change (see the module docstring), read when the grader starts."""

    def __init__(self, root: Path, course_notebooks: Path, allow_modified: bool = False):
        self.root, self.notebooks = Path(root), Path(course_notebooks)
        self.origin, release = released(self.root) if not allow_modified else ("the working tree (as it is)", {})
        self._verified: dict[str, tuple] = {}  # .pyc path -> stat it was verified at
        self.state = self._scan()
        problems = [] if allow_modified else self._against_release(release)
        if problems:
            unrecorded = any("environment record" in p for p in problems)
            raise CourseChanged(f"the course differs from {self.origin}: " + "; ".join(problems[:10])
                                + (" ..." if len(problems) > 10 else "") + " (restore it, e.g. git checkout and git "
                                "clean in lessonlib/, or pass --allow-modified-course to grade with it as it is"
                                + ("; start-up files the environment had when it was installed are recorded by "
                                   "python -m lessonlib.grading.release" if unrecorded else "") + ")")

    def _scan(self) -> dict[str, bytes | str]:
        state: dict[str, bytes | str] = {}
        for folder in (self.root / "lessonlib", self.notebooks):
            for dirpath, dirnames, filenames in os.walk(folder):  # symbolic links are listed, not followed
                if ".ipynb_checkpoints" in dirpath:
                    continue
                for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                    path = Path(dirpath) / name
                    state[str(path)] = _read(path)
        for path in self.root.iterdir():
            if ROOT_MODULE.search(path.name) or SHADOWING.search(path.name) or path.name == "__pycache__":
                for p in ([path] if path.name != "__pycache__" else sorted(path.iterdir())):
                    state[str(p)] = _read(p)
        state.update(_startup_files())
        return state

    def _pyc_is_its_source(self, path: Path) -> bool:
        """Whether a ``__pycache__/x.<tag>.pyc`` beside a released ``x.py`` holds exactly that source compiled (what
        Python would load; a forged one passes Python's own check, which compares only a time and a size)."""
        match = re.fullmatch(r"(.+)\.([^.]+)(\.opt-(\d))?\.pyc", path.name)
        source = path.parent.parent / f"{match.group(1)}.py" if match else None
        if match is None or match.group(2) != sys.implementation.cache_tag:
            return match is not None  # another interpreter's cache: this Python never loads it
        stat = path.stat()
        key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if self._verified.get(str(path)) == key:
            return True
        try:
            data, text, info = path.read_bytes(), source.read_bytes(), source.stat()
            flags = int.from_bytes(data[4:8], "little")
            if flags == 0:  # checked by time and size: one that does not match is stale, and Python recompiles
                stale = data[8:16] != ((int(info.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                                       + (info.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
            else:  # by hash: checked (flags 3) ones are recompiled when the hash differs; unchecked ones are not
                stale = flags == 3 and data[8:16] != importlib.util.source_hash(text)
            code = compile(text, str(source), "exec", dont_inherit=True, optimize=int(match.group(4) or 0))
            good = data[:4] == importlib.util.MAGIC_NUMBER and (stale or marshal.loads(data[16:]) == code)
        except (OSError, ValueError, EOFError, TypeError, SyntaxError):
            good = False
        if good:
            self._verified[str(path)] = key
        return good

    def _against_release(self, release: dict[str, bytes | str]) -> list[str]:
        problems = []
        for rel, expected in release.items():
            if not rel.startswith("lessonlib/"):
                continue
            got = self.state.get(str(self.root / rel))
            digest = hashlib.sha256(got).hexdigest() if isinstance(got, bytes) else None
            if got is None:
                problems.append(f"{rel} is missing")
            elif got != expected and digest != expected:
                problems.append(f"{rel} differs")
        for path in self.state:
            rel = os.path.relpath(path, self.root)
            if rel.startswith("..") or rel in release:
                continue
            if Path(path).parent.name == "__pycache__" and rel.startswith("lessonlib/"):
                if not self._pyc_is_its_source(Path(path)):
                    problems.append(f"{rel} is not its source compiled")
            elif rel.startswith("lessonlib/") or "/" not in rel or rel.startswith("__pycache__/"):
                problems.append(f"{rel} is not released")
        recorded, listed = _environment_record(), _recorded_pth()
        for path, data in self.state.items():
            if Path(path).is_relative_to(self.root) or not SHADOWING.search(Path(path).name):
                continue
            if recorded.get(path) == _digest(data):
                continue  # there at install, as it is now
            if path.endswith(".pth") and path not in listed:
                problems.append(f"{path} is listed by no installed package nor in the environment record")
            elif not path.endswith(".pth") and Path(path).is_relative_to(sys.prefix):
                problems.append(f"{path} runs before every import")
        return problems

    def pristine(self, folder: Path) -> Path:
        """Write lessonlib as read at the start into ``folder``/lessonlib, compiled by the grader (the sandboxes
        write no bytecode), read-only; returns ``folder``, the sandbox's PYTHONPATH."""
        base = self.root / "lessonlib"
        for path, data in self.state.items():
            if Path(path).is_relative_to(base) and isinstance(data, bytes) and "__pycache__" not in path:
                target = folder / Path(path).relative_to(self.root)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        compileall.compile_dir(folder / "lessonlib", quiet=2, workers=1)
        for dirpath, _, filenames in os.walk(folder):
            os.chmod(dirpath, 0o755)
            for name in filenames:
                os.chmod(os.path.join(dirpath, name), 0o444)
        return folder

    def repair(self) -> list[str]:
        """Compare the course with the start; put back each changed or removed file and remove each new one (a
        ``.pyc`` Python wrote from the released source is kept). Returns what was found, [] if nothing."""
        now = self._scan()
        found = []
        for path in sorted(set(now) | set(self.state)):
            before, after = self.state.get(path), now.get(path)
            if before == after:
                continue
            if before is None and Path(path).parent.name == "__pycache__" and self._pyc_is_its_source(Path(path)):
                self.state[path] = after  # Python compiled a released module: not a change
                continue
            found.append(os.path.relpath(path, self.root) if Path(path).is_relative_to(self.root) else path)
            target = Path(path)
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.is_dir():
                shutil.rmtree(target)
            if isinstance(before, bytes):
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(before)
        return found


if __name__ == "__main__":
    checkout = Path(__file__).resolve().parents[2]
    if _git(checkout, "rev-parse", "HEAD") is None:
        print(f"wrote {write_manifest(checkout)}")
    print(f"wrote {write_environment()}")
