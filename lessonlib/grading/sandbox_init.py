"""The ``unshare`` sandbox's set-up, run as root of a new user, mount and PID namespace (see
:mod:`lessonlib.grading.sandbox`); standard library only (it runs as ``python -I -S``)::

    sandbox_init.py mount WRITABLE WORK WORK_BYTES [HIDDEN ...] -- KEY=VALUE ... -- COMMAND ...
    sandbox_init.py watch PROCESSES -- COMMAND ...

``mount`` mounts a fresh /proc, tmpfs on /tmp, /dev/shm, ``WORK`` and each ``HIDDEN`` folder, keeps ``WRITABLE`` (the socket
folder) writable, makes every other mount read-only, then runs ``COMMAND`` with exactly that environment and no
capability left (a process without them cannot undo a mount). Any mount that fails stops it: no half-built sandbox.

``watch`` is the PID namespace's init (both sandboxes): it runs ``COMMAND``, reaps every orphan, and kills every
process of the namespace once there are more than ``PROCESSES`` (a fork bomb); it exits with ``COMMAND``'s status,
and the namespace's other processes die with it.
"""

import os
import signal
import subprocess
import sys
import time


def mount(*args: str, keep_fd: int | None = None) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True, pass_fds=() if keep_fd is None
                            else (keep_fd,))
    if result.returncode != 0:
        sys.exit(f"lessonlib.grading sandbox: mount {' '.join(args)} failed: {result.stderr.strip()}")


def mounts() -> list[tuple[str, str]]:
    """(mount point, its per-mount options) of every mount, from /proc/self/mountinfo (octal escapes undone)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            found.append((point, fields[5]))
    return found


def watch(argv: list[str]) -> None:
    limit, command = int(argv[0]), argv[argv.index("--") + 1:]
    child = os.fork()
    if child == 0:
        os.execvp(command[0], command)
    while True:
        time.sleep(0.01)  # a fork bomb gets 10 ms; a fork of a kernel with torch loaded takes about 1 ms
        running = sum(1 for name in os.listdir("/proc") if name.isdigit())
        if running > limit:
            os.write(2, f"lessonlib.grading: more than {limit} processes: every one was stopped\n".encode())
            os.kill(-1, signal.SIGKILL)  # from PID 1: every process of the namespace but this one
            os._exit(137)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(0)
            if pid == 0:
                break
            if pid == child:
                os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def mount_and_run(argv: list[str]) -> None:
    split = argv.index("--")
    writable, work, work_bytes, *hidden = argv[:split]
    rest = argv[split + 1:]
    split = rest.index("--")
    env = dict(item.split("=", 1) for item in rest[:split])
    command = rest[split + 1:]
    sockets = os.open(writable, os.O_PATH | os.O_DIRECTORY)  # still reachable once the folders above it are hidden
    mount("--make-rprivate", "/")
    mount("-t", "proc", "proc", "/proc")
    for folder in (*hidden, "/tmp", "/dev/shm"):
        if os.path.isdir(folder):  # (one that is gone is inside a folder already hidden)
            mount("-t", "tmpfs", "-o", f"size={work_bytes},mode=1777", "tmpfs", folder)
    os.makedirs(writable, exist_ok=True)
    mount("--no-canonicalize", "--bind", f"/proc/self/fd/{sockets}", writable, keep_fd=sockets)
    os.close(sockets)
    os.makedirs(work, exist_ok=True)
    mount("-t", "tmpfs", "-o", f"size={work_bytes},mode=755", "tmpfs", work)
    for sub in ("home", "tmp"):
        os.makedirs(os.path.join(work, sub), exist_ok=True)
    keep = (writable, work, "/tmp", "/dev/shm", "/proc")  # ours: fresh, and what lies under them is out of sight
    for point, options in mounts():
        if any(point == k or point.startswith(k.rstrip("/") + "/") for k in keep) or options.split(",")[0] == "ro":
            continue
        flags = ",".join("ro" if o == "rw" else o for o in options.split(","))
        mount("-o", f"remount,bind,{flags}", point)
    os.chdir(work)
    os.execvpe("setpriv", ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--", *command],
               env)


if __name__ == "__main__":
    (watch if sys.argv[1] == "watch" else mount_and_run)(sys.argv[2:])
