"""tests/forkserver.py runs `run_python`'s scripts as `python -c` would: each thing a script may see of its
process (its code, its exit, its output, its folder and environment, its `__main__`) compared with a fresh
interpreter's, and what a fork cannot give sent to one."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.forkserver import ForkServer

SCRIPTS = {
    "prints": "print('out'); import sys; print('err', file=sys.stderr)",
    "raises": "raise ValueError('the message')",
    "exits": "import sys; sys.exit(3)",
    "exits with a message": "import sys; sys.exit('a message')",
    "dies of a signal": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
    "interrupted": "raise KeyboardInterrupt",
    "its process": textwrap.dedent("""
        import json, os, sys, __main__
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "asked": os.environ.get("ASKED"),
                          "main_file": getattr(__main__, "__file__", None), "path0": sys.path[0],
                          "stdin": sys.stdin.read()}))
    """),
    "atexit runs": "import atexit; atexit.register(lambda: print('at exit'))",
    "unflushed output": "import sys; sys.stdout.write('no newline')",
    "its builtins": "print(__builtins__.__name__)",
    "its temporary folder": "import os, tempfile; print(tempfile.gettempdir() == os.environ['TMPDIR'])",
    "its time zone": "import time; print(time.tzname)",
}


@pytest.fixture(scope="module")
def server():
    server = ForkServer()
    yield server
    server.close()


@pytest.mark.parametrize("form,name", [("-c", name) for name in SCRIPTS] +
                         [("file", name) for name in ("its process", "raises", "dies of a signal")])
def test_a_forked_script_is_seen_as_a_fresh_interpreters(server, name, form, tmp_path):
    (tmp_path / "tmp").mkdir()
    env = {**server.env, "ASKED": "yes", "TMPDIR": str(tmp_path / "tmp"), "TZ": "Asia/Tokyo"}
    if form == "-c":
        argv = ["-c", SCRIPTS[name], "an argument"]
    else:
        (tmp_path / "scripts").mkdir()
        (tmp_path / "scripts" / "script.py").write_text(SCRIPTS[name])
        argv = ["scripts/script.py", "an argument"]
    fresh = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, env=env,
                           timeout=60, stdin=subprocess.DEVNULL)
    forked = server.run(argv, tmp_path, env, timeout=60)
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    if name == "interrupted":  # a KeyboardInterrupt's traceback shows the server's frames above the script's
        assert forked.stderr.splitlines()[-2:] == fresh.stderr.splitlines()[-2:]
    else:
        assert forked.stderr == fresh.stderr


def test_a_script_past_its_time_is_killed_and_raises_as_subprocess_run_does(server, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(["-c", "import time; print('started', flush=True); time.sleep(60)"], tmp_path, server.env, timeout=1)
    assert server.run(["-c", "print('next')"], tmp_path, server.env, timeout=60).stdout == "next\n"  # the server goes on


def test_each_forked_script_has_random_states_of_its_own(server, tmp_path):
    script = "import numpy, random, torch; print(torch.initial_seed(), numpy.random.rand(), random.random())"
    first, second = (server.run(["-c", script], tmp_path, server.env, timeout=60).stdout.split() for _ in range(2))
    assert all(a != b for a, b in zip(first, second)), (first, second)


def test_what_a_fork_cannot_run_as_python_would_goes_to_a_fresh_interpreter(server, tmp_path):
    (tmp_path / "script.py").write_text("pass")
    assert server.forkable(server.env, ["script.py", "an argument"], tmp_path)
    assert server.forkable(server.env, ["-c", "pass"], tmp_path)
    for argv in (["-m", "json.tool"], ["-u", "script.py"], ["-W", "error", "-c", "pass"], ["-c"], ["missing.py"], []):
        assert not server.forkable(server.env, argv, tmp_path), argv


def test_an_environment_read_at_a_librarys_load_goes_to_a_fresh_interpreter(server):
    assert server.forkable({**server.env, "AUTOTUNE_ANYTHING": "1"})
    assert not server.forkable({**server.env, "OMP_NUM_THREADS": "7"})
    assert not server.forkable({**server.env, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not server.forkable({**server.env, "LC_ALL": "C"})  # Python's encodings, set at its start
    unset = {key: value for key, value in server.env.items() if key != "MALLOC_ARENA_MAX"}
    assert not server.forkable(unset)


def test_onednns_cache_capacity_asked_of_a_forked_script_is_the_one_it_gets(server, tmp_path):
    # oneDNN reads it at its first primitive, in the child: the one environment key forked though read by a library.
    from autotune.memory import onednn

    if not onednn.available():
        pytest.skip("this torch does not export oneDNN's cache functions")
    script = textwrap.dedent("""
        import ctypes, torch
        from autotune.memory import onednn
        torch.nn.functional.conv2d(torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3))
        capacity = ctypes.c_int(-1)
        onednn._load().get_capacity(ctypes.byref(capacity))
        print(capacity.value)
    """)
    env = {**server.env, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
    assert server.forkable(env)
    unasked = server.run(["-c", script], tmp_path, server.env, timeout=60).stdout
    asked = server.run(["-c", script], tmp_path, env, timeout=60).stdout
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60).stdout
    assert asked == fresh == "0\n" and unasked != asked


def test_run_python_and_python_fork_in_a_worker_and_start_fresh_when_asked(tmp_path, monkeypatch):
    from tests.conftest import python, run_python

    script = "import sys; save({'parent': __import__('os').getppid(), 'torch': 'torch' in sys.modules})"
    monkeypatch.delenv("AUTOTUNE_TESTS_FRESH", raising=False)  # a suite run with it set
    _, forked = run_python(script, tmp_path)
    assert forked["parent"] != os.getpid() and forked["torch"]  # the server's child, torch imported there
    (tmp_path / "file.py").write_text("import os; print(os.getppid())")
    for argv in (["-c", "import os; print(os.getppid())"], ["file.py"]):  # conftest.python's, env or none
        for env in ({}, {"PYTHONPATH": str(tmp_path)}):
            assert int(python(argv, tmp_path, env, timeout=60).stdout) != os.getpid(), (argv, env)
    monkeypatch.setenv("AUTOTUNE_TESTS_FRESH", "1")
    _, fresh = run_python(script, tmp_path)
    assert fresh["parent"] == os.getpid() and not fresh["torch"]
    assert int(python(["file.py"], tmp_path, {}, timeout=60).stdout) == os.getpid()


def test_scripts_asked_at_once_run_at_once(server, tmp_path):
    # A test's threads run scripts side by side (tests/test_moving_in.py, the sizing tests' two models).
    import concurrent.futures
    import time

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(server.run, ["-c", f"import time; time.sleep(2); print({i})"], tmp_path, server.env, 60)
                for i in range(3)]
        assert [run.result().stdout for run in runs] == ["0\n", "1\n", "2\n"]
    assert time.monotonic() - started < 5  # not 6 s, one after another


@pytest.mark.parametrize("form", ["-c", "file"])
def test_a_python_path_asked_for_is_the_one_a_fresh_interpreter_has(server, form, tmp_path):
    script = "import json, sys; print(json.dumps(sys.path))"
    (tmp_path / "script.py").write_text(script)
    argv = ["-c", script] if form == "-c" else ["script.py"]
    env = {**server.env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "a"), "relative/b"])}
    assert server.forkable(env)
    fresh = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert server.run(argv, tmp_path, env, timeout=60).stdout == fresh.stdout


def test_a_forked_script_has_the_resource_limits_of_the_process_that_asked(server, tmp_path):
    # subprocess.run's child inherits the worker's limits as they are then (a test's cap on itself, say);
    # the server's child takes them from the request, not from the server's start.
    import resource

    script = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_AS))"
    before = {limit: resource.getrlimit(limit) for limit in (resource.RLIMIT_NOFILE, resource.RLIMIT_AS)}
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, before[resource.RLIMIT_NOFILE][1]))
        resource.setrlimit(resource.RLIMIT_AS, (2**46, before[resource.RLIMIT_AS][1]))
        fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
        forked = server.run(["-c", script], tmp_path, server.env, timeout=60).stdout
    finally:
        for limit, value in before.items():
            resource.setrlimit(limit, value)
    assert forked == fresh and "(200, " in forked
    assert server.run(["-c", script], tmp_path, server.env, timeout=60).stdout != forked  # and lifted again


def test_threads_that_ask_for_the_server_at_once_share_one(monkeypatch):
    import concurrent.futures
    import time

    import tests.conftest as conftest

    monkeypatch.delenv("AUTOTUNE_TESTS_FRESH", raising=False)
    monkeypatch.setattr(conftest, "_server", None)
    started = []

    class Slow:  # a server takes seconds to start: the window where a second thread would start another
        def __init__(self):
            time.sleep(0.2)
            started.append(self)

        def close(self):
            pass

    monkeypatch.setattr(conftest, "ForkServer", Slow)
    monkeypatch.setattr(conftest.atexit, "register", lambda close: None)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        servers = list(pool.map(lambda _: conftest._fork_server(), range(8)))
    assert len(started) == 1 and all(server is started[0] for server in servers)
