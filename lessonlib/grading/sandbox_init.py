"""The ``unshare`` sandbox's set-up, run as root of a new user, mount and PID namespace (see
:mod:`lessonlib.grading.sandbox`); standard library only (it runs as ``python -I -S``)::

    sandbox_init.py mount SPEC_JSON -- KEY=VALUE ... -- COMMAND ...
    sandbox_init.py watch PROCESSES -- COMMAND ...

``mount`` builds a new root on an empty tmpfs: a fresh /proc, tmpfs on /tmp, /dev/shm and the working folder, the
socket folder writable, the few device files a Python needs, and read-only binds of exactly the paths of
``sandbox.view`` (the system's libraries, the Python environment, the released lessonlib); it changes root into it and
runs ``COMMAND`` with exactly that environment and no capability left (a process without them cannot undo a mount).
Any mount that fails stops it: no half-built sandbox.

``watch`` is the PID namespace's init (both sandboxes): it runs ``COMMAND``, reaps every orphan, and kills every
process of the namespace once there are more than ``PROCESSES`` (a fork bomb); it exits with ``COMMAND``'s status,
and the namespace's other processes die with it.
"""

import json
import os
import signal
import subprocess
import sys
import time


def mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"lessonlib.grading sandbox: mount {' '.join(args)} failed: {result.stderr.strip()}")


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
    spec = json.loads(argv[0])
    rest = argv[split + 1:]
    split = rest.index("--")
    env = dict(item.split("=", 1) for item in rest[:split])
    command = rest[split + 1:]
    root, size = spec["root"], spec["bytes"]

    def inside(point):
        return os.path.join(root, point.lstrip("/"))

    mount("--make-rprivate", "/")
    mount("-t", "tmpfs", "-o", "size=1m,mode=755", "tmpfs", root)  # a new, empty root: only what is bound below
    for folder in ("/tmp", "/dev/shm"):
        os.makedirs(inside(folder), exist_ok=True)
        mount("-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", inside(folder))
    os.makedirs(inside("/proc"))
    mount("-t", "proc", "proc", inside("/proc"))
    devices = [f"/dev/{name}" for name in ("null", "zero", "full", "random", "urandom", "tty")] + spec["devices"]
    view = {**spec["view"], **{d: ["dev", d] for d in devices if os.path.exists(d)}}
    for point, (kind, source) in view.items():  # parents first (sandbox.view's order)
        target = inside(point)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if kind == "link":
            os.symlink(source, target)
            continue
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            open(target, "a").close()
        mount("--bind", source, target)
        mount("-o", "remount,bind,ro" + (",nosuid,noexec" if kind == "dev" else ",nosuid,nodev"), target)
    os.makedirs(inside(spec["writable"]), exist_ok=True)
    mount("--bind", spec["writable"], inside(spec["writable"]))
    os.makedirs(inside(spec["work"]), exist_ok=True)
    mount("-t", "tmpfs", "-o", f"size={size},mode=755", "tmpfs", inside(spec["work"]))
    for sub in ("home", "tmp"):
        os.makedirs(os.path.join(inside(spec["work"]), sub), exist_ok=True)
    mount("-o", "remount,ro,bind", root)
    os.chroot(root)
    os.chdir(spec["work"])
    os.execvpe("setpriv", ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs", "--", *command],
               env)


if __name__ == "__main__":
    (watch if sys.argv[1] == "watch" else mount_and_run)(sys.argv[2:])
