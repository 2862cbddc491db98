"""One interpreter per pytest worker that has imported torch, forked for each script of `run_python` and `python`.

A fresh interpreter spends ~2 CPU-s importing torch and ~2 more on torch._dynamo, which an optimizer's first
call imports: about 200 scripts a suite run, on two cores, spent minutes there. A child forked from this
server starts with both imported and runs its script as `python -c` or `python FILE` would: its own `__main__`,
`sys.argv`, the environment and folder asked for, stdout and stderr into files, and the interpreter's own exit
(atexit handlers, an uncaught exception's traceback and code 1, a signal's death).

What a fork cannot give falls back to a fresh interpreter (`forkable`): an environment that differs from the
server's where a library reads it once, at its load (OpenMP, oneDNN, malloc, torch, Python's own, the locale),
interpreter options and `-m`, a file that is not there. A child's random states are its own (torch and numpy
reseeded, TMPDIR and TZ read again), and its resource limits are its asker's at the time it asks (a worker under
a test's cap passes it on; the server itself lifts its soft limits, so a cap never stops its imports). What stays the server's, by design or found by a hostile review:
- its memory: torch and torch._dynamo imported, so a child's virtual and resident sizes, and its peaks, start
  from the server's (a cap set in the child from its own size, as the tests' scripts set theirs, is unmoved);
- the hash seed (PYTHONHASHSEED unset), torch's loggers and warnings filters before the script imports torch;
- stdout and stderr are files, read when the child ends: a grandchild that outlives it is not waited for (a
  pipe would be), and its later lines are lost; stdin is /dev/null;
- a KeyboardInterrupt's traceback and faulthandler's dumps show the server's frames above the script's;
- the child's CPU time reaches the worker's `getrusage(RUSAGE_CHILDREN)` only when the server ends.

The server reads one JSON request a line on its stdin, forks at once, and answers on its stdout, each line
naming its request: the child's pid, then, when it ends, its exit status. It ends when its stdin closes (the
worker ended). No threads run in it, so a fork is safe.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Read once, at a library's load, in the server's fork as in a fresh interpreter; a request that differs
# from the server's environment in one of these runs in a fresh interpreter.
READ_AT_LOAD = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "ONEDNN_", "DNNL_", "MALLOC_", "LD_", "PYTHON",
                "TORCH", "PYTORCH_", "CUDA_", "ATEN_", "NVIDIA_", "GLIBC_", "KINETO_", "SYMPY_", "COVERAGE_",
                "LC_", "LANG")  # LC_ and LANG: Python's encodings and UTF-8 mode, set at its start
# Read later: oneDNN reads its cache's capacity at its first primitive, which the server never builds
# (tests/test_forkserver.py checks it).
# PYTHONPATH: its folders are put on sys.path in the child, where a fresh interpreter has them.
READ_LATER = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY", "PYTHONPATH"}

# The resource limits a child takes from the process that asked for it (a test's cap on the worker, say).
LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_FSIZE", "RLIMIT_STACK")

_SERVE = f"import runpy; runpy.run_path({__file__!r}, run_name='tests_forkserver')['serve']()"


def serve() -> None:
    """The server's loop (run by `_SERVE` in a `python -c` interpreter, so sys.path is a `-c` child's):
    a child forked for each request as it comes, each child's end answered as it comes (scripts run at
    once, as a test's threads ask)."""
    import gc
    import select
    import signal

    # Started by a worker under a test's cap (soft RLIMIT_AS), the server would import torch under it: each
    # child gets its asker's limits instead (`_become`).
    for name in LIMITS:
        limit = getattr(resource, name)
        resource.setrlimit(limit, (resource.getrlimit(limit)[1],) * 2)

    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (what an optimizer's first call imports)

    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # nothing of the server's own on the replies' pipe
    woken, wake = os.pipe()
    os.set_blocking(woken, False), os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)  # a child's end (SIGCHLD) wakes the select below
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    gc.collect()
    gc.freeze()  # the objects of the imports stay shared with the children (no copy on the GC's writes)
    children: dict[int, int] = {}  # pid -> its request's id
    pending = b""
    while True:
        ready, _, _ = select.select([requests, woken], [], [])
        while woken in ready:
            try:
                os.read(woken, 512)
            except BlockingIOError:
                break
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _reply(replies, id=children.pop(pid), returncode=os.waitstatus_to_exitcode(status))
        if requests not in ready:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:
            return  # the worker ended
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (requests, replies, woken, wake):
                    os.close(fd)
                _become(request, null)
                return  # the child: its script ran; the interpreter ends as `python -c` does
            children[pid] = request["id"]
            _reply(replies, id=request["id"], pid=pid)


def _reply(replies: int, **reply: int) -> None:
    os.write(replies, (json.dumps(reply) + "\n").encode())  # one write, under PIPE_BUF: never interleaved


def _become(request: dict, null: int) -> None:
    # In the forked child: the process `python *argv` would be (`-c CODE ...` or `FILE ...`), then its code.
    import builtins
    import time
    import types

    import torch

    for name, (soft, hard) in request["limits"].items():  # the asker's, as a child of its own would have them
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.chdir(request["cwd"])
    _python_path(os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", ""))
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR read again
    time.tzset()  # TZ
    # A fresh interpreter's random states are its own: torch and numpy seed from the OS at their import
    # (Python's random reseeds itself after a fork). The hash seed stays the server's: PYTHONHASHSEED unset.
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.dup2(null, 0)
    os.close(null)
    argv = request["argv"]
    main = types.ModuleType("__main__")  # `-c`: no __file__, so multiprocessing's spawn treats it as `-c`'s
    main.__builtins__ = builtins
    if argv[0] == "-c":
        sys.argv, filename, code = ["-c", *argv[2:]], "<string>", argv[1]
    else:  # a file: its folder first on sys.path, its path in __file__ (spawn's children run it again)
        sys.argv, filename = list(argv), os.path.abspath(argv[0])  # absolute, as Python 3.9+ gives it
        sys.path[0] = os.path.dirname(os.path.realpath(filename))
        main.__file__ = filename
        with open(filename) as source:
            code = source.read()
    sys.modules["__main__"] = main
    try:
        exec(compile(code, filename, "exec"), main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own ending: an exit code, or death by SIGINT
    except BaseException as error:  # noqa: BLE001  (reported as the interpreter reports it, then exit 1)
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename == __file__:
            trace = trace.tb_next  # the script's frames only, as a fresh interpreter shows them
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        raise SystemExit(1) from None


def _python_path(server: str, asked: str) -> None:
    # PYTHONPATH's folders, made absolute, between sys.path[0] (the script's folder, or "" for -c) and the
    # standard ones, as at a fresh start.
    if server == asked:
        return
    standard = sys.path[1 + len([folder for folder in server.split(os.pathsep) if folder]):]
    sys.path[1:] = [*(os.path.abspath(folder) for folder in asked.split(os.pathsep) if folder), *standard]


class ForkServer:
    """The client, in a pytest worker: `run(argv, ...)` is `subprocess.run([python, *argv], capture_output=True,
    text=True, timeout=..., cwd=..., env=...)`, argv `["-c", code, ...]` or `[file, ...]`, for a forkable
    environment; several threads may run at once."""

    def __init__(self) -> None:
        self.env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
        self.server = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=self.env)
        self.lock = threading.Lock()
        self.asked = 0
        self.waiting: dict[int, dict] = {}  # request id -> its replies, and events set as they come
        threading.Thread(target=self._read_replies, daemon=True).start()

    def forkable(self, env: dict[str, str], argv: list[str] | None = None, cwd: Path | None = None) -> bool:
        """Whether `python *argv` in `env` (and `cwd`) runs forked as it would fresh: `-c CODE` or an existing
        FILE (no interpreter options, no -m), in an environment no library read at its load differs in."""
        if argv is not None:
            first = str(argv[0]) if argv else "-"
            if first == "-c" and len(argv) < 2 or first != "-c" and (
                    first.startswith("-") or not (Path(cwd or ".") / first).is_file()):
                return False
        keys = {key for key in {*env, *self.env} if key.startswith(READ_AT_LOAD) and key not in READ_LATER}
        return self.server.poll() is None and all(env.get(key) == self.env.get(key) for key in keys)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "out", Path(folder) / "err"
            slot = {"started": threading.Event(), "ended": threading.Event()}
            with self.lock:
                self.asked += 1
                self.waiting[self.asked] = slot
                request = {"id": self.asked, "argv": [str(arg) for arg in argv], "cwd": str(cwd), "env": env,
                           "stdout": str(out), "stderr": str(err),
                           "limits": {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS}}
                self.server.stdin.write((json.dumps(request) + "\n").encode())
                self.server.stdin.flush()
            slot["started"].wait()
            if "pid" not in slot:
                raise RuntimeError(f"the tests' fork server ended (code {self.server.wait()})")
            try:
                ended = slot["ended"].wait(timeout)
            finally:  # past its time, or the wait cut short (pytest-timeout's SIGALRM, ^C): as subprocess.run does
                if not slot["ended"].is_set():
                    _kill(slot["pid"])
                    slot["ended"].wait()
            stdout, stderr = (path.read_text() if path.exists() else "" for path in (out, err))  # strict, as text=True
            command = [sys.executable, *argv]
            if not ended:
                raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
            if "returncode" not in slot:
                raise RuntimeError(f"the tests' fork server ended (code {self.server.wait()})")
            return subprocess.CompletedProcess(command, slot["returncode"], stdout, stderr)

    def _read_replies(self) -> None:
        for line in self.server.stdout:
            reply = json.loads(line)
            slot = self.waiting[reply["id"]]
            slot.update(reply)
            slot["started" if "pid" in reply else "ended"].set()
            if "returncode" in reply:
                del self.waiting[reply["id"]]
        for slot in list(self.waiting.values()):  # the server ended: no more answers
            slot["started"].set(), slot["ended"].set()

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:  # it ended meanwhile
        pass
