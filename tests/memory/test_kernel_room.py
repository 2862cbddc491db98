"""Never a signal mid-retry (issue 56, item 11): under RLIMIT_AS, a bf16 step whose matmuls oneDNN
builds at a new micro-batch size gets an OOM where oneDNN would have been refused an allocation it
does not check (autotune/memory/kernel_room.py). A real cap in a subprocess where torch sends bf16 to
oneDNN; the condition simulated elsewhere, as the autocast relief's skip is."""

import json
import types

import pytest
import torch
from torch import nn

from autotune.memory import kernel_room, onednn
from autotune.common.oom import is_oom
from tests.conftest import run_python

ON_ONEDNN = onednn.runs_on_onednn(torch.bfloat16)

# The shape of issue 56's crash: the step's matmuls at micro-batch sizes tried one after another
# (16, 12, 8, 7, 6, 5, as halving and fitting do), oneDNN's cache emptied before each as a size
# change does, the cap 64 KiB higher each round, then wide. Before the check, on an AVX512_BF16
# Xeon, 5 at 192 KiB of headroom died of SIGSEGV in matmul_pd_t, run after run (with one OpenMP
# thread and glibc's mmap threshold fixed before the warm-up, as the examples run: otherwise where
# the refusal falls moves with the heap's free chunks, and the crash comes and goes).
SCRIPT = r'''
import torch
from torch import nn
from autotune import Tuner
from autotune.memory.limits import fix_mmap_threshold, runs_under

fix_mmap_threshold()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Linear(64, 4096)).to(torch.bfloat16)

def step(model, m):  # the micro-batch made under the cap, as a loader's is
    return model(torch.randn(m * 64, 64, dtype=torch.bfloat16)).float().logsumexp(-1).mean()

with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step, device="cpu", monitor=False,
           run_dir=RUN_DIR) as tuner:
    tuner.core.forward_backward(8)  # warm, uncapped
    said = {"fits": [], "refused": 0}
    for headroom in [k * 64 * 1024 for k in range(8)] + [16 * 2**20, 96 * 2**20]:  # 16 needs 68 MiB here
        for m in (16, 12, 8, 7, 6, 5):
            if runs_under(headroom, lambda: tuner.core.forward_backward(m)):
                said["fits"].append([headroom, m])
            else:
                said["refused"] += 1
save(said)
'''


@pytest.mark.slow
@pytest.mark.skipif(not ON_ONEDNN, reason="torch keeps bf16 off oneDNN on this CPU (no AVX-512): nothing to refuse")
def test_bf16_retried_at_new_sizes_under_a_cap_runs_out_of_memory_and_never_dies_of_a_signal(tmp_path):
    proc, said = run_python(f"RUN_DIR = {str(tmp_path / 'run')!r}\n" + SCRIPT, tmp_path, timeout=240,
                            env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and said is not None, (proc.returncode, proc.stderr[-3000:])  # -11: SIGSEGV
    assert said["refused"] > 0  # the tight caps refused...
    assert [m for headroom, m in said["fits"] if headroom == 96 * 2**20] == [16, 12, 8, 7, 6, 5], said  # wide: all


FIRST_USE = r'''
import sys, torch
from autotune.memory import kernel_room
from autotune.memory.limits import cap_address_space, lift_address_space_cap

kernel_room.warm()  # what the step core does when it is made
cap_address_space(0)  # not a page more
try:
    with kernel_room.guard({torch.bfloat16}, kernel_room.address_space_cap(torch.device("cpu"))):
        torch.ones(64, 64, dtype=torch.bfloat16) @ torch.ones(64, 64, dtype=torch.bfloat16)
    said = "ran"
except Exception as exc:
    said = f"{type(exc).__name__}: {exc}"
lift_address_space_cap()
save(said)
'''


@pytest.mark.slow
@pytest.mark.skipif(not ON_ONEDNN, reason="torch keeps bf16 off oneDNN on this CPU (no AVX-512): nothing to check")
def test_the_first_check_under_a_tight_cap_is_an_oom_not_a_failed_import(tmp_path):
    # A dispatch mode's first op imports torch._dynamo (263 MiB of address space): under the cap that
    # was an ImportError ("failed to map segment"), which no retry takes for an OOM (with a page or more
    # of room, a MemoryError at every size: the run gave up). warm() runs it first.
    proc, said = run_python(FIRST_USE, tmp_path, timeout=120)
    assert said is not None and said.startswith("OutOfMemoryError: out of memory: less than 4.0 MiB"), \
        (said, proc.stderr[-2000:])


def capped_on_onednn(monkeypatch):
    # The condition where the check is made, simulated: a cap, and torch sending bf16 to oneDNN.
    monkeypatch.setattr(kernel_room, "address_space_cap", lambda device: 1 << 40 if device.type == "cpu" else None)
    monkeypatch.setattr(kernel_room, "runs_on_onednn", lambda dtype: dtype is torch.bfloat16)


def test_the_check_is_made_only_where_a_cap_a_low_precision_dtype_and_onednn_meet(monkeypatch):
    monkeypatch.setattr(kernel_room, "runs_on_onednn", lambda dtype: True)
    assert kernel_room.guard({torch.bfloat16}, None) is kernel_room.NOTHING  # no cap
    capped_on_onednn(monkeypatch)
    room = kernel_room.guard({torch.float32, torch.bfloat16}, 1 << 40)
    assert isinstance(room, kernel_room.KernelRoom) and room.dtypes == {torch.bfloat16} and room.cap == 1 << 40
    assert kernel_room.guard({torch.float32}, 1 << 40) is kernel_room.NOTHING  # fp32 goes to MKL
    assert kernel_room.guard({torch.float16}, 1 << 40) is kernel_room.NOTHING  # this "CPU" keeps fp16 off oneDNN


def test_the_cap_is_read_once_a_second_at_once_after_autotune_sets_one_and_only_on_cpu(tmp_path, monkeypatch):
    # A system call costs a ~1 ms step about 10 us in this VM (1%): a steady step reads the cap once a
    # second, on the clock (the vDSO's, no system call), and at once after autotune's own cap_address_space.
    from autotune import Tuner
    from autotune.memory import limits

    # cap_address_space's other setting, glibc's mmap threshold, would stay for the rest of this process
    monkeypatch.setattr(limits, "fix_mmap_threshold", lambda: None)
    read, clock = [], [1000.0]
    real = kernel_room.address_space_cap
    monkeypatch.setattr(kernel_room, "address_space_cap", lambda device: read.append(device.type) or real(device))
    monkeypatch.setattr(kernel_room, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    model = nn.Linear(8, 2)
    batch = (torch.randn(8, 8), torch.randint(0, 2, (8,)))
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy,
               device="cpu", monitor=False, run_dir=tmp_path / "run", micro_batch_size=2) as tuner:
        tuner.step(batch)
        assert read == ["cpu"]  # the first step's first forward
        read.clear()
        tuner.step(batch)  # four micro-batches, each a forward and a backward
        tuner.core.kernel_room()  # outside an attempt (evaluation, a relief)
        clock[0] += kernel_room.REREAD_SECONDS * 0.99
        tuner.step(batch)
        assert read == []
        clock[0] += kernel_room.REREAD_SECONDS * 0.01
        tuner.step(batch)
        assert read == ["cpu"]  # a second on
        try:
            cap = limits.cap_address_space(2**40)
            assert tuner.core._cap.cap() == cap  # at once
        finally:
            limits.lift_address_space_cap()
        assert tuner.core._cap.cap() is None and len(read) == 3
    assert real(torch.device("meta")) is None and kernel_room.CapReader(torch.device("meta")).cap() is None


def test_an_op_without_its_room_is_an_oom_that_names_it_and_the_rest_run(monkeypatch):
    asked = []
    monkeypatch.setattr(kernel_room, "room_for", lambda n, cap: asked.append((n, cap)) or False)
    a, b = torch.randn(320, 64, dtype=torch.bfloat16), torch.randn(64, 4096, dtype=torch.bfloat16)
    with kernel_room.KernelRoom(frozenset({torch.bfloat16}), 1 << 40):
        assert torch.equal(a.float() + 1, a.float() + 1)  # not a product: not asked
        assert (a.float() @ b.float()).shape == (320, 4096)  # fp32: MKL's, not asked
        assert asked == []
        with pytest.raises(torch.OutOfMemoryError) as raised:
            a @ b
    assert asked == [(320 * 4096 * 2 + kernel_room.RESERVE_BYTES, 1 << 40)]  # the output and oneDNN's reserve
    assert is_oom(raised.value)
    assert "aten.mm on [320, 64] x [64, 4096] (torch.bfloat16)" in str(raised.value)
    assert "RLIMIT_AS" in str(raised.value)


def test_backward_is_checked_too_and_the_room_found_lets_it_run(monkeypatch):
    # The issue's crash was in backward (AddmmBackward0 -> mm): the check sees the gradients' products.
    seen = []

    def room(n, cap):
        seen.append(n)
        return True

    monkeypatch.setattr(kernel_room, "room_for", room)
    layer = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with kernel_room.KernelRoom(frozenset({torch.bfloat16}), 1 << 40):
        layer(x).float().sum().backward()
    reserve = kernel_room.RESERVE_BYTES
    # forward addmm (8x32), backward: the input's gradient is not needed; the weight's (32x64) is
    assert seen[0] == 8 * 32 * 2 + reserve and 32 * 64 * 2 + reserve in seen[1:], seen
    assert layer.weight.grad is not None


def test_a_retry_goes_on_below_the_size_the_check_refused(tmp_path, monkeypatch):
    # The check's OOM is an OOM like any other: the Tuner halves and retries the same batch, which
    # then trains. Here the room is simulated: 1.5 MiB above the reserve, so 8 x 64 rows of 4096
    # bf16 logits (4 MiB) are refused and 2 x 64 (1 MiB) run.
    from autotune import Tuner

    capped_on_onednn(monkeypatch)
    monkeypatch.setattr(kernel_room, "room_for", lambda n, cap: n <= kernel_room.RESERVE_BYTES + 1.5 * 2**20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4096)).to(torch.bfloat16)
    batch = (torch.randn(8 * 64, 64, dtype=torch.bfloat16), torch.randint(0, 4096, (8 * 64,)))
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy,
               device="cpu", monitor=False, run_dir=tmp_path / "run") as tuner:
        tuner.step(batch)
    # The size the batch trained at (the Tuner's own may grow after it, from the memory it measured)
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert step["micro_batch_size"] <= 2 * 64, step
    records = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    ooms = [r for r in records if r["kind"] == "oom"]
    assert ooms and all("RLIMIT_AS cap for aten." in r["message"] for r in ooms), ooms



def test_the_room_is_the_cap_less_the_virtual_size_and_nothing_is_mapped_to_find_it():
    # Read, not mapped: a mapping would raise the lifetime peak (VmPeak) the step's demand is measured by.
    import resource

    from autotune.memory.demand import StepPeak

    kernel_room.warm()
    status = StepPeak(torch.device("cpu")).status
    before = status()
    above_peak = before.virtual_peak - before.virtual + 32 * 2**20  # mapped, this would be a new lifetime peak
    cap = before.virtual + above_peak + 32 * 2**20
    assert kernel_room.room_for(above_peak, cap) and not kernel_room.room_for(above_peak + 64 * 2**20, cap)
    assert status().virtual_peak == before.virtual_peak
    assert kernel_room.room_for(1 << 50, resource.RLIM_INFINITY)  # no cap


def test_the_pruning_relief_runs_its_model_under_the_check_too(tmp_path, monkeypatch):
    # Pruning traces the model with a captured micro-batch: bf16 kernels of their own, under the same cap.
    from autotune import Tuner
    from autotune.common.actions import PruneChannels

    capped_on_onednn(monkeypatch)
    asked = []
    monkeypatch.setattr(kernel_room, "room_for", lambda n, cap: asked.append(n) or True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)).to(torch.bfloat16)
    batch = (torch.randn(16, 8, dtype=torch.bfloat16), torch.randint(0, 3, (16,)))
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy,
               device="cpu", run_dir=tmp_path / "run", monitor=False) as tuner:
        tuner.step(batch)
        asked.clear()
        assert tuner.carry_out(PruneChannels(ratio=0.25))
        assert asked  # the traced forward's products
        assert model[0].weight.shape == (24, 8)


@pytest.mark.parametrize("autocast_inside", [True, False], ids=["bf16 inside the step", "fp32"])
def test_a_step_that_autocasts_on_its_own_is_checked_and_an_fp32_one_only_until_it_is_known(
        tmp_path, monkeypatch, autocast_inside):
    # HF's bf16=True and Lightning's bf16-mixed autocast inside the step autotune calls, with
    # precision="fp32" and fp32 weights: the first attempt under the check sees what the products
    # run in; bf16 stays checked, an fp32 step is let be (no mode, no cost).
    from autotune import Tuner

    capped_on_onednn(monkeypatch)
    asked = []
    monkeypatch.setattr(kernel_room, "room_for", lambda n, cap: asked.append(n) or True)

    def step(model, batch):
        inputs, targets = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_inside):
            return nn.functional.cross_entropy(model(inputs).float(), targets)

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    batch = (torch.randn(8, 8), torch.randint(0, 2, (8,)))
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step, device="cpu", monitor=False,
               run_dir=tmp_path / "run") as tuner:
        tuner.step(batch)
        first = len(asked)
        tuner.step(batch)
        entered = tuner.core.kernel_room()
    if autocast_inside:
        assert first > 0 and len(asked) == 2 * first  # every product of both steps
        assert isinstance(entered, kernel_room.KernelRoom) and entered.dtypes == {torch.bfloat16}
    else:
        assert asked == [] and entered is kernel_room.NOTHING
