"""Where a submission's code runs: a sandbox around each process the grader starts for a notebook (its kernel, its
runner, the judge), and the capped files their raw output goes to.

Three ways, the first that works on this machine (``auto``), or the one ``--sandbox`` / ``LESSONLIB_GRADING_SANDBOX``
names:

- ``bwrap`` (bubblewrap, ``apt-get install bubblewrap``): an empty root with, read-only, only :func:`view`'s paths
  (the system's programs and libraries, the Python environment, ``Box.readable``: the grader's pristine lessonlib),
  bound after ``/tmp``'s tmpfs so that a course or a Python under ``/tmp`` is seen; ``/tmp``, ``/dev/shm`` and the
  notebook's working folder size-capped tmpfs, the kernel's socket folder the one host folder it can write; new
  user, PID, network, IPC and UTS namespaces; it dies with the grader.
- ``unshare`` (util-linux, unprivileged user namespaces): the same namespaces and the same view, built on a new root
  by :mod:`lessonlib.grading.sandbox_init` inside them, which then drops every capability and runs the command.

In both, the command runs under ``sandbox_init.py watch``, the PID namespace's init: it reaps, and stops the whole
sandbox (the notebook's kernel dies) once it holds more than ``processes`` processes: a fork bomb ends there.
- ``none``: the process runs as the grader's user with an allowlisted environment, capped output and its process
  group killed at the end; nothing stops it writing the grader's files or escaping its process group. Only with
  ``--unsafe-no-sandbox``: without it the grader refuses.

Both also set ``RLIMIT_FSIZE`` (one file's size) and, where it holds, ``RLIMIT_NPROC`` (a fork fails past it): not for
root, except where an unprivileged uid can run this Python and read the checkout; then the sandbox runs as a uid of
its own (``SANDBOX_UID`` + the job's slot).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

MODES = ("auto", "bwrap", "unshare", "none")
SANDBOX_UID = 61000  # first uid of the sandboxed processes when the grader runs as root (one per job)
ENV_KEPT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "VIRTUAL_ENV",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TRITON_INTERPRET", "LESSONLIB_MODE", "LESSONLIB_GPU_PROFILE",
            "LESSONLIB_PDL", "LESSONLIB_FAST_LAUNCH",
            "HF_HUB_OFFLINE")  # what a kernel needs from the grader's environment; nothing else
RISK = ("the grader runs submissions UNSANDBOXED ({why}): a notebook can write any file the grader's user can "
        "(the checkout, grades.csv), start processes that outlive it and reach the network. Install bubblewrap "
        "(apt-get install bubblewrap) or allow unprivileged user namespaces.")


class SandboxUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Box:
    """One sandboxed process's view: ``writable`` (the socket folder, shared with the grader), ``work`` (its working
    folder: a tmpfs of ``work_bytes`` inside the sandbox, with ``HOME`` and ``TMPDIR``), ``hidden`` (folders it must
    not see) and its limits."""

    mode: str
    writable: Path
    work: Path
    hidden: tuple[Path, ...]
    work_bytes: int
    processes: int
    file_bytes: int
    slot: int = 0
    readable: tuple[Path, ...] = ()  # host folders it sees read-only (the released lessonlib), besides view()'s
    passwd: Path | None = None  # its /etc/passwd (its own uids only; written by prepare())


def _probe(argv: list[str]) -> str | None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return None if result.returncode == 0 else (result.stderr.strip().splitlines() or ["failed"])[-1][:200]


@functools.lru_cache(maxsize=None)
def choose(mode: str = "auto") -> tuple[str, str]:
    """(the mode that works here, why the others do not). ``mode`` names one; ``auto`` tries bwrap, then unshare.
    Each is tried by running ``python -c pass`` in a sandbox like a notebook's."""
    if mode not in MODES:
        raise ValueError(f"sandbox must be one of {MODES}, got {mode!r}")
    why = []
    for candidate in ("bwrap", "unshare") if mode == "auto" else (mode,):
        if candidate == "none":
            return "none", "chosen with --sandbox none"
        if shutil.which(candidate) is None:
            why.append(f"{candidate} is not installed")
            continue
        with tempfile.TemporaryDirectory(prefix="lessonlib-sandbox-probe-") as folder:
            os.chmod(folder, 0o755)
            box = Box(candidate, Path(folder) / "sockets", Path(folder) / "work", (), 1 << 20, 4096, 1 << 20,
                      passwd=Path(folder) / "passwd")
            prepare(box)
            error = _probe(wrap(box, [sys.executable, "-c", "pass"], environment(box, {})))
        if error is None:
            return candidate, ""
        why.append(f"{candidate} cannot make its namespaces here: {error}")
    if mode != "auto":
        raise SandboxUnavailable("; ".join(why))
    return "none", "; ".join(why)


def _as_sandbox_user(slot: int) -> list[str]:
    """As root, where an unprivileged uid can run this Python and read the checkout: become a uid of this job's
    own, so that RLIMIT_NPROC holds (the kernel does not apply it to root)."""
    if os.geteuid() != 0 or not _open_to_others():
        return []
    uid = SANDBOX_UID + slot
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


@functools.lru_cache(maxsize=None)
def _open_to_others() -> bool:
    """Whether another uid can run this Python, read the checkout and reach the temporary folder (where the
    sandbox's folders are made: a TMPDIR of mode 0700, as pytest's, keeps them from a uid of the sandbox's own)."""
    from lessonlib.grading.notebook_run import ROOT

    for target in (Path(os.path.realpath(sys.executable)), ROOT / "lessonlib" / "__init__.py"):
        if not _reachable(target.parent) or not target.stat().st_mode & 0o004:
            return False
    return _reachable(Path(os.path.realpath(tempfile.gettempdir())))


def _reachable(folder: Path) -> bool:
    """Every folder from ``folder`` up to the root can be entered by any uid."""
    return all(f.stat().st_mode & 0o001 for f in (folder, *folder.parents))


def _limits(box: Box) -> list[str]:
    """The process and file-size limits, and the watch that stops the sandbox past ``box.processes`` processes
    (which also holds where RLIMIT_NPROC does not: as root)."""
    processes = box.processes
    if os.geteuid() != 0:  # the limit counts every process of the user: leave room for the ones already running
        processes += _tasks_of(os.getuid())
    nproc = [f"--nproc={processes}"] if os.geteuid() != 0 or _as_sandbox_user(box.slot) else []
    return ["prlimit", *nproc, f"--fsize={box.file_bytes}", "--core=0", "--"]


def _watch(box: Box) -> list[str]:
    return [sys.executable, "-I", "-S", str(Path(__file__).with_name("sandbox_init.py")), "watch",
            str(box.processes), "--"]


def _tasks_of(uid: int) -> int:
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in text:
            count += int(next((line.split()[1] for line in text.splitlines() if line.startswith("Threads:")), 1))
    return count


def environment(box: Box, extra: dict[str, str]) -> dict[str, str]:
    """The allowlisted environment: what a kernel needs, the sandbox's own folders, ``extra``; no other variable of
    the grader's."""
    home, tmp = box.work / "home", box.work / "tmp"
    env = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}
    # No bytecode written anywhere (the mounts are read-only too): a .pyc is how code would outlive its process.
    return {**env, "HOME": str(home), "TMPDIR": str(tmp), "XDG_CACHE_HOME": str(home / ".cache"),
            "MPLBACKEND": "Agg", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", "USER": "student",
            "LOGNAME": "student", **extra}


# What a sandbox sees of the host's system folders: its programs and libraries (the loader's cache, not the rest of
# /etc). The Python environment and the course's lessonlib come from :func:`python_paths` and ``Box.readable``.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
          "/etc/ld.so.conf.d", "/etc/alternatives")


def python_paths() -> list[str]:
    """The Python environment the grader runs: the venv (as named and as resolved) and its base interpreter."""
    found = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)]
    return list(dict.fromkeys(p for p in found + [os.path.realpath(p) for p in found] if p))


def _under(path, folder) -> bool:
    path, folder = str(path).rstrip("/") or "/", str(folder).rstrip("/") or "/"
    return path == folder or path.startswith(folder + "/") or folder == "/"


def _entries(path: str, found: dict, depth: int = 0) -> None:
    """``path`` as the sandbox must see it: each symbolic link on the way reproduced, the real folder bound."""
    path = os.path.normpath(os.path.abspath(path))
    parts = path.split("/")[1:]
    for i in range(1, len(parts) + 1):
        prefix = "/" + "/".join(parts[:i])
        if depth < 16 and os.path.islink(prefix):
            target = os.readlink(prefix)
            found.setdefault(prefix, ("link", target))
            _entries(os.path.join(os.path.dirname(prefix), target, *parts[i:]), found, depth + 1)
            return
    if os.path.exists(path):
        found.setdefault(path, ("ro", path))


def view(box: Box) -> dict[str, tuple[str, str]]:
    """{path in the sandbox: ("ro", host path) or ("link", target)}: everything it sees of the host, read-only.
    Parents before children; a path inside one already bound is left out (it is seen through it)."""
    found: dict[str, tuple[str, str]] = {}
    init = str(Path(__file__).with_name("sandbox_init.py"))  # the sandbox's init, run from the grader's copy
    gpu = ("/sys",) if list(Path("/dev").glob("nvidia*")) else ()  # the CUDA driver reads the devices' /sys entries
    for path in (*SYSTEM, *gpu, *python_paths(), *map(str, box.readable), init):
        _entries(path, found)
    if box.passwd is not None:
        found["/etc/passwd"] = ("ro", str(box.passwd))
    kept: dict[str, tuple[str, str]] = {}
    for point in sorted(found, key=lambda p: (p.count("/"), p)):
        if not any(kind == "ro" and _under(point, other) and point != other for other, (kind, _) in kept.items()):
            kept[point] = found[point]
    return kept


def wrap(box: Box, argv: list[str], env: dict[str, str]) -> list[str]:
    """``argv`` run inside ``box``, with exactly ``env``. For mode ``none``: ``argv`` under ``env`` (the caller
    passes ``env`` to the process, which also starts its own session)."""
    if box.mode == "none":
        return list(argv)
    if box.mode == "unshare":
        devices = [str(d) for d in sorted(Path("/dev").glob("nvidia*")) + [Path("/dev/dri")] if d.exists()]
        spec = [json.dumps({"root": str(box.work.parent / "root"), "bytes": box.work_bytes, "view": view(box),
                            "writable": str(box.writable), "work": str(box.work), "devices": devices})]
        return [*_as_sandbox_user(box.slot), *_limits(box), "unshare", "--user", "--map-root-user", "--mount",
                "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child", "--",
                sys.executable, "-I", "-S", str(Path(__file__).with_name("sandbox_init.py")), "mount", *spec, "--",
                *(f"{k}={v}" for k, v in env.items()), "--", *_watch(box), *argv]
    args = ["bwrap", "--die-with-parent", "--unshare-all", "--as-pid-1", "--dev", "/dev", "--proc", "/proc",
            "--size", str(box.work_bytes), "--tmpfs", "/tmp", "--size", str(box.work_bytes), "--tmpfs", "/dev/shm"]
    # Then the read-only view (after /tmp's tmpfs, so that a course or a Python under /tmp is seen): the system's
    # libraries, the Python environment, the course's released lessonlib; nothing else of the host.
    for point, (kind, source) in view(box).items():
        args += ["--symlink", source, point] if kind == "link" else ["--ro-bind", source, point]
    for device in sorted(Path("/dev").glob("nvidia*")) + [Path("/dev/dri")]:  # the GPU, where there is one
        if device.exists():
            args += ["--dev-bind", str(device), str(device)]
    for folder in box.hidden:
        if any(_under(folder, p) for p in box.readable):
            args += ["--tmpfs", str(folder)]
    args += ["--bind", str(box.writable), str(box.writable),
             "--size", str(box.work_bytes), "--tmpfs", str(box.work),
             "--dir", str(box.work / "home"), "--dir", str(box.work / "tmp"), "--chdir", str(box.work),
             "--remount-ro", "/", "--cap-drop", "ALL", "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return [*_as_sandbox_user(box.slot), *_limits(box), *args, "--", *_watch(box), *argv]


def prepare(box: Box) -> None:
    """Make the folders the sandbox binds, owned by the uid the sandboxed process runs as, and its /etc/passwd
    (Python's getpass and some libraries look their uid up there; the host's own names stay unseen)."""
    for folder in (box.writable, box.work, box.work / "home", box.work / "tmp", box.work.parent / "root"):
        folder.mkdir(parents=True, exist_ok=True)
        hand_over(box, folder)
    if box.passwd is not None:
        uid = os.getuid() if not _as_sandbox_user(box.slot) else SANDBOX_UID + box.slot
        box.passwd.write_text(f"root:x:0:0::/:/bin/false\nstudent:x:{uid}:{uid}::{box.work / 'home'}:/bin/false\n")


def hand_over(box: Box, path: Path) -> None:
    """Give ``path`` to the uid the sandboxed process runs as, where it runs as one of its own (as root, see
    :func:`_as_sandbox_user`): a file the grader writes for it with mode 0600 (the kernel's connection file) is
    otherwise unreadable there."""
    if os.geteuid() == 0 and box.mode != "none" and _as_sandbox_user(box.slot):
        os.chown(path, SANDBOX_UID + box.slot, SANDBOX_UID + box.slot)


class CappedSink:
    """A pipe whose reader keeps the first ``cap`` bytes in ``path`` and drops the rest (counted): a process's raw
    stdout and stderr, so that it cannot flood the grader's own or fill the disk."""

    def __init__(self, path: Path, cap: int):
        self.path, self.cap, self.dropped = path, cap, 0
        read, self.fd = os.pipe()
        self._thread = threading.Thread(target=self._drain, args=(read,), daemon=True)
        self._thread.start()

    def _drain(self, read: int) -> None:
        kept = 0
        with os.fdopen(read, "rb") as pipe, open(self.path, "wb") as out:
            while chunk := pipe.read1(1 << 16):
                keep = chunk[: max(0, self.cap - kept)]
                out.write(keep)
                kept += len(keep)
                self.dropped += len(chunk) - len(keep)
            if self.dropped:
                out.write(f"\n[lessonlib.grading: {self.dropped:,} bytes past {self.cap:,} dropped]\n".encode())

    def close_writer(self) -> None:
        """Once the process has it: the grader's copy of the write end closed, so the reader ends with the process."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def join(self, timeout: float = 10.0) -> None:
        self.close_writer()
        self._thread.join(timeout)


def stop(process) -> None:
    """Kill ``process`` and its process group, and wait for it. In a sandbox its PID namespace goes with it (every
    process the notebook started); unsandboxed, a process that left the group is out of reach."""
    import signal

    for target in (lambda: os.killpg(process.pid, signal.SIGKILL), process.kill):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass
    process.wait()
