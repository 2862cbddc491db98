"""Every stop is a stop (issue 56, item 7): SIGHUP and SIGUSR1 (and the stop signals a user names),
SIGTERM to the whole process group with loader workers, the user's sys.exit and a signal repeated
while the stop is written each checkpoint the last completed step and exit with the code a launcher
acts on. Real processes, real signals (os.kill, os.killpg on a session of its own)."""

import concurrent.futures
import io
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from autotune import AutoTrainer
from autotune.training.batch_in_hand import END, BatchInHand
from autotune.stops.preemption import Preempted, StopRequests, stop_signals
from autotune.stops.stall import StallWatch
from autotune.ranks.distributed import Solo
from tests.conftest import journal

SCRIPT = """
import os, sys, time
import torch
from torch import nn
from torch.utils.data import Dataset, DataLoader
from autotune import AutoTrainer

run_dir, scenario = sys.argv[1], sys.argv[2]

class Samples(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if scenario == "exit" and i == 27:  # batch 4 of 8: steps 1..3 are done
            sys.exit(3)
        time.sleep(0.002)  # workers busy with the next batches when the signal comes
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.tensor(i % 2)

class Ready:
    def on_step_end(self, trainer):
        if trainer.step == 3:
            open(os.path.join(run_dir, "ready"), "w").close()
        time.sleep(0.02)

width = 2048 if scenario == "twice" else 16  # twice: a checkpoint of 17 MB, so the stop outlasts 50 ms
data = DataLoader(Samples(), batch_size=8, num_workers=2) if scenario == "group_users_loader" else Samples()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 2))
trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=8, shuffle=False,
                      num_workers=2 if scenario in ("group", "group_int") else 0, device="cpu", monitor=False,
                      progress=False, checkpoint_interval=None, run_dir=run_dir, callbacks=[Ready()],
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                      **({"stop_signals": ["SIGUSR2"]} if scenario == "usr2" else {}))
trainer.fit(epochs=1000)
"""


def _send(process: subprocess.Popen, how: str) -> None:
    if how == "group":  # scancel, systemctl stop, kill -- -PGID: the trainer and its workers at once
        os.killpg(process.pid, signal.SIGTERM)
    elif how == "group_int":  # Ctrl-C at a terminal: its foreground group
        os.killpg(process.pid, signal.SIGINT)
    elif how == "twice":  # a launcher forwarding to a group: one more 50 ms later
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
    elif how != "none":
        os.kill(process.pid, getattr(signal, how))


def _run(tmp_path: Path, scenario: str, how: str) -> tuple[int, str, Path]:
    run_dir = tmp_path / scenario
    run_dir.mkdir()
    process = subprocess.Popen([sys.executable, str(tmp_path / "train.py"), str(run_dir), scenario],
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 120
        while how != "none" and not (run_dir / "ready").exists():
            assert process.poll() is None, (scenario, process.stderr.read()[-2000:])
            assert time.monotonic() < deadline, f"{scenario}: not 3 steps in after 120 s"
            time.sleep(0.02)
        _send(process, how)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, stderr, run_dir


# scenario, what is sent, the exit code, the checkpoint's reason, a line on stderr. On the old code (98d9912):
# killed by SIGHUP, by SIGUSR1, exit 1 ("DataLoader worker ... exited unexpectedly") twice, Ctrl-C to the group
# held (130), exit 3 with no checkpoint and nothing said, killed by the second SIGTERM, no stop_signals argument.
CASES = [("hup", "SIGHUP", 129, "signal SIGHUP", "stopped by SIGHUP at step"),
         ("usr1", "SIGUSR1", 138, "signal SIGUSR1", "stopped by SIGUSR1 at step"),
         ("group", "group", 143, "signal SIGTERM", "stopped by SIGTERM at step"),
         ("group_users_loader", "group", 143, "signal SIGTERM", "stopped by SIGTERM at step"),
         ("group_int", "group_int", 130, "signal SIGINT", "stopped by SIGINT at step"),
         ("exit", "none", 3, "exit", "sys.exit(3) in the training (a dataset, step_fn or callback) at step 3 "
                                     "(the error came while loading or training batch 4 of epoch 1"),
         ("twice", "twice", 143, "signal SIGTERM", "SIGTERM again: the stop goes on"),
         ("usr2", "SIGUSR2", 140, "signal SIGUSR2", "stopped by SIGUSR2 at step")]


@pytest.mark.slow
def test_every_stop_checkpoints_the_last_completed_step_and_exits_with_its_code(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)

    def check(case):
        scenario, how, code, reason, said = case
        returncode, stderr, run_dir = _run(tmp_path, scenario, how)
        assert returncode == code, (scenario, returncode, stderr[-3000:])
        assert f"autotune: {said}" in stderr, (scenario, stderr[-3000:])
        assert "Traceback" not in stderr and "DataLoader worker" not in stderr, (scenario, stderr[-3000:])
        records = journal(run_dir)
        (checkpoint,) = [r for r in records if r["kind"] == "checkpoint"]
        assert checkpoint["reason"] == reason, (scenario, checkpoint)
        # Whole and loadable (twice: the second SIGTERM came during the stop), of the last completed step.
        state = torch.load(checkpoint["path"], weights_only=True)
        assert state["progress"]["step"] == checkpoint["step"] and checkpoint["step"] >= 3, (scenario, checkpoint)
        if scenario == "exit":
            assert checkpoint["step"] == 3
        else:
            (preempted,) = [r for r in records if r["kind"] == "preempted"]
            assert preempted["checkpoint"] == checkpoint["path"], scenario
            assert f"stopped by {preempted['signal']} at step {checkpoint['step']}" in stderr, scenario

    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        list(pool.map(check, CASES))


# ---------------------------------------------------------------------------------------------- in process


def test_stop_signals_are_named_or_numbered_and_refused_where_they_cannot_stop_a_run():
    assert stop_signals(None) == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
    assert stop_signals(["usr2", 15, signal.SIGTERM, "SIGHUP"]) == (signal.SIGUSR2, signal.SIGTERM, signal.SIGHUP)
    assert stop_signals("SIGUSR1") == (signal.SIGUSR1,) and stop_signals(()) == ()
    for bad, words in (("SIGKILL", "SIGKILL cannot be a stop signal: it cannot be caught"),
                       (["TERM", "SIGSEGV"], "SIGSEGV cannot be a stop signal: it is a fault"),
                       ("SIGCHLD", "SIGCHLD cannot be a stop signal"), ("SIGFOO", "'SIGFOO' is not a signal's name"),
                       (4242, "4242 is not a signal number")):
        with pytest.raises(ValueError, match="stop_signals: " + words.replace("(", r"\(")):
            stop_signals(bad)
    with pytest.raises(TypeError, match=r"stop_signals=\[1.5\]: 1.5 is neither"):
        stop_signals([1.5])


def _in_a_child(body) -> None:
    """Run `body` in a forked child: a signal that kills it (the old handlers gave the default action
    back) fails this test instead of ending the test session. No torch kernel may run there: OpenMP's
    thread pool does not survive a fork (a parallel op waits forever for threads that are gone)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except BaseException:  # noqa: BLE001 - shown, and the child's exit code says it
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if ended[0] == 0:  # hung: never left behind
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the child did not end within 60 s")
    status = ended[1]
    assert not os.WIFSIGNALED(status), f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    assert os.WEXITSTATUS(status) == 0, "the child's assertion failed (its traceback is on stderr)"


def test_a_repeated_signal_is_said_and_ignored_and_ctrl_c_three_times_aborts(capfd):
    def body():
        before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        stop = StopRequests()
        with stop:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the old handler had put SIG_DFL back: this one killed the process
            os.kill(os.getpid(), signal.SIGINT)
            assert (stop.signum, stop.repeats) == (signal.SIGTERM, 2)
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)  # the third Ctrl-C: a person who insists
        assert {sig: signal.getsignal(sig) for sig in before} == before  # no Preempted left: all put back

    _in_a_child(body)
    err = capfd.readouterr().err
    assert err.count("autotune: SIGTERM again: the stop goes on (a checkpoint of the last completed step, then exit "
                     "143); Ctrl-C 3 times aborts at once, without it") == 1, err


def test_after_a_stop_a_repeat_cannot_cut_the_exit_short_and_the_next_fit_puts_the_handlers_back():
    def body():
        stop = StopRequests((signal.SIGUSR1, signal.SIGINT))
        with pytest.raises(Preempted):
            with stop:
                os.kill(os.getpid(), signal.SIGUSR1)
                raise Preempted(signal.SIGUSR1, "stopped")
        os.kill(os.getpid(), signal.SIGUSR1)  # on its way out: ignored (SIG_DFL would end the process)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works in a notebook after
        with StopRequests((signal.SIGUSR1,)):
            assert signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL

    _in_a_child(body)


def test_a_signal_the_process_ignores_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with StopRequests() as stop:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.signum is None
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_handler_set_outside_python_is_left_alone_and_said(capfd):
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` dumps the stacks: a debugging idiom worth keeping
    try:
        with StopRequests((signal.SIGTERM, signal.SIGUSR1)) as stop:
            assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # Python's record: faulthandler's still there
            assert signal.getsignal(signal.SIGTERM) == stop._handle
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        faulthandler.unregister(signal.SIGUSR1)
    assert "SIGUSR1 has a handler set outside Python's signal module (faulthandler.register?)" \
        in capfd.readouterr().err


class _Batches:
    def __init__(self):
        self.items = iter([torch.zeros(2), torch.ones(2)])

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.items)


def test_a_signal_at_any_instruction_of_fetch_is_the_stop_never_a_bare_stoppedwhilewaiting():
    # A real SIGTERM, sent from a tracer at each bytecode of BatchInHand.fetch in turn: it lands there
    # (the handler runs at once, in the tracer's frame). On the old code, one landing after the `try`
    # escaped as a bare StoppedWhileWaiting; any outcome but the batch (with the stop flagged) or
    # Preempted fails here.
    code = BatchInHand.fetch.__code__
    outcomes = set()
    offset = 0
    while True:
        stop = StopRequests((signal.SIGTERM,))
        in_hand = BatchInHand(lambda *a: "", ranks=Solo(), folder=Path("."), stop_pending=stop.pending,
                              preempted=lambda signum, path: Preempted(signum, f"stopped, {path}"))
        watch = StallWatch(in_hand, lambda position: None, None, ranks=Solo())
        watch.stop()
        stop.interrupts = watch.interrupts
        seen = [0]

        def tracer(frame, event, arg):
            if frame.f_code is not code:
                return None
            frame.f_trace_opcodes = True
            if event == "opcode":
                seen[0] += 1
                if seen[0] == offset + 1:
                    os.kill(os.getpid(), signal.SIGTERM)
            return tracer

        with stop:
            sys.settrace(tracer)
            try:
                batch = in_hand.fetch(_Batches(), 0, 0, 0, 0, time.perf_counter(), save=lambda reason: Path(reason))
                outcome = "batch" if batch is not END else "end"
            except Preempted as exc:
                outcome = str(exc)
            finally:
                sys.settrace(None)
        if seen[0] <= offset:  # past the last instruction: every one was tried
            break
        assert stop.signum == signal.SIGTERM, offset
        assert outcome in ("batch", "stopped, signal SIGTERM"), (offset, outcome)
        outcomes.add(outcome)
        offset += 1
    assert outcomes == {"batch", "stopped, signal SIGTERM"} and offset > 10


def test_a_signal_during_the_stops_checkpoint_does_not_abandon_it(tmp_path):
    # The second SIGTERM is sent from inside the checkpoint's write (its first chunk): a real signal at
    # the worst moment. On the old code the first put SIG_DFL back and this one killed the process.
    path = tmp_path / "step-3.pt"
    weights = torch.arange(300_000.0)  # made here: the child only writes it

    class Interrupted(io.FileIO):
        def write(self, data):
            if self.tell() == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().write(data)

    def save(reason):
        with Interrupted(path, "w") as f:
            torch.save({"weights": weights, "reason": reason}, f)
        return path

    def body():
        stop = StopRequests((signal.SIGTERM,))
        in_hand = BatchInHand(lambda *a: "", ranks=Solo(), folder=tmp_path, stop_pending=stop.pending,
                              preempted=lambda signum, saved: Preempted(signum, f"stopped, {saved}"))
        with stop:
            os.kill(os.getpid(), signal.SIGTERM)  # after the last step's check: the next fetch stops
            with pytest.raises(Preempted, match=f"stopped, {path}"):
                in_hand.fetch(_Batches(), 0, 0, 0, 3, time.perf_counter(), save=save)
        assert stop.repeats == 1

    _in_a_child(body)
    state = torch.load(path, weights_only=True)  # whole
    assert state["reason"] == "signal SIGTERM" and state["weights"].equal(weights)


class _ExitAt(Dataset):
    def __init__(self, at):
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.at = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g), at

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == self.at:
            sys.exit(3)
        return self.x[i], self.y[i]


@pytest.mark.parametrize("where", ["getitem", "step_fn", "callback"])
def test_the_users_sys_exit_checkpoints_the_last_completed_step_and_says_so(tmp_path, capfd, where):
    def step(model, batch):
        if where == "step_fn" and trainer.step == 5:
            sys.exit(3)
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    class Callback:
        def on_step_end(self, trainer):
            if where == "callback" and trainer.step == 5:
                sys.exit(3)

    torch.manual_seed(0)
    data = _ExitAt(41 if where == "getitem" else None)  # batch 6 of 8 (samples 40..47)
    trainer = AutoTrainer(nn.Linear(8, 1), data, step_fn=step, batch_size=8, device="cpu", progress=False,
                          shuffle=False, monitor=False, run_dir=tmp_path / "run", callbacks=[Callback()],
                          checkpoint_interval=None)
    with pytest.raises(SystemExit) as raised:
        trainer.fit(epochs=2)
    trainer.close()
    assert raised.value.code == 3 and not isinstance(raised.value, Preempted)
    (checkpoint,) = [r for r in journal(tmp_path / "run") if r["kind"] == "checkpoint"]
    assert (checkpoint["reason"], checkpoint["step"]) == ("exit", 5)  # steps 1..5 done, the 6th not
    assert torch.load(checkpoint["path"], weights_only=True)["progress"]["step"] == 5
    err = capfd.readouterr().err
    assert "sys.exit(3) in the training (a dataset, step_fn or callback) at step 5" in err, err
    assert f"the training up to step 5 is in the checkpoint {checkpoint['path']}" in err, err


def test_a_fit_puts_the_stop_handlers_back_and_leaves_a_signal_it_does_not_own_alone(tmp_path):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    seen = []

    class During:
        def on_step_end(self, trainer):
            seen.append({sig: signal.getsignal(sig) for sig in before})

    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    with AutoTrainer(nn.Linear(8, 1), data, loss_fn=nn.functional.mse_loss, batch_size=8, device="cpu",
                     progress=False, monitor=False, run_dir=tmp_path / "run", callbacks=[During()],
                     stop_signals=["SIGTERM"]) as trainer:
        trainer.fit()
    assert seen[0][signal.SIGTERM] != before[signal.SIGTERM]  # the trainer's, during the fit
    assert seen[0][signal.SIGUSR1] == before[signal.SIGUSR1]  # not one of its stop signals
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert not isinstance(getattr(signal.getsignal(signal.SIGCHLD), "__self__", None), StopRequests)  # torch's again


@pytest.mark.slow
def test_a_worker_stuck_in_getitem_still_ends_when_an_epoch_is_left_early(tmp_path):
    # The workers of the loader autotune builds ignore SIGTERM (a group's stop); torch's terminate() of
    # a worker that did not end within its 5 s join must still end it, or it would hold the process's exit.
    from autotune.data.pipeline import InputPipeline
    from autotune.ranks.distributed import Solo

    marker = tmp_path / "stuck"
    pipeline = InputPipeline(_Stuck(marker), batch_size=4, shuffle=False, seed=0, num_workers=2, collate_fn=None,
                             device=torch.device("cpu"), ranks=Solo())
    batches = pipeline.batches(0, 0, 0)
    next(batches)
    workers = pipeline._handed_out()._workers
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "no worker stuck"
        time.sleep(0.05)
    started = time.monotonic()
    del batches  # max_steps reached, a rebuild: the epoch's iterator dropped
    took = time.monotonic() - started
    assert not any(w.is_alive() for w in workers) and took < 9, took  # torch's 5 s join, then terminate()


class _Stuck(Dataset):
    def __init__(self, marker: Path):
        self.marker = marker

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 9:  # the third batch: a read that never returns
            self.marker.touch()
            time.sleep(600)
        return torch.zeros(2)


def test_a_stop_after_the_last_batch_still_stops_after_the_end_checkpoint(tmp_path):
    # A SIGTERM during the last epoch's end (its callbacks, an evaluation, the end checkpoint): the run is
    # done and saved, and the process still exits 143 (on the old code fit returned and the script went on).
    class StopAtTheEnd:
        def on_epoch_end(self, trainer):
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    try:
        with AutoTrainer(nn.Linear(8, 1), data, loss_fn=nn.functional.mse_loss, batch_size=8, device="cpu",
                         progress=False, monitor=False, run_dir=tmp_path / "run", callbacks=[StopAtTheEnd()]) as trainer:
            with pytest.raises(Preempted) as raised:
                trainer.fit(epochs=1)
    finally:
        signal.signal(signal.SIGTERM, before)  # Preempted left SIGTERM ignored until the process exits
    assert raised.value.code == 143
    records = journal(tmp_path / "run")
    (checkpoint,) = [r for r in records if r["kind"] == "checkpoint"]
    assert (checkpoint["reason"], checkpoint["step"]) == ("end", 2)
    assert [r["checkpoint"] for r in records if r["kind"] == "preempted"] == [checkpoint["path"]]
