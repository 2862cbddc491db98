"""A relief that cannot be carried out leaves the model as it was and ends in a clear error.

Real OOMs under RLIMIT_AS: nothing fits even at micro-batch 1 (the gradients alone are more
than the cap leaves), so the default preset climbs its ladder; pruning's own importance
estimate then runs out of memory too. The user must get `autotune.OutOfMemory` with the
figures, the journal a `relief_failed`, and the model its shapes and weights: never a signal,
whichever kernels oneDNN picks (the machine's best ISA, and the lowest through
ONEDNN_MAX_CPU_ISA), with the last completed step checkpointed before the first relief.
"""

import json

import pytest
import torch

from autotune.memory.onednn import native_bf16
from tests.conftest import journal, run_python

pytestmark = pytest.mark.slow  # a subprocess under RLIMIT_AS

SCRIPT = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer, OutOfMemory
from autotune.memory.limits import cap_address_space, lift_address_space_cap

# oneDNN on, as a user has it: on a CPU with native bf16 (AMX) autocast would build its bf16 kernels
# for the first time under the cap, where an allocation oneDNN does not check can crash the process
# (SIGSEGV right after the autocast relief, issue 48): that relief is skipped there, with a word.

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4096, 8192), nn.ReLU(), nn.Linear(8192, 10))
data = TensorDataset(torch.randn(64, 4096), torch.randint(0, 10, (64,)))
trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=8, device="cpu",
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.01), progress=False, monitor=False,
                      checkpoint_interval=None, run_dir=RUN_DIR)
trainer.fit(max_steps=1)  # one warm-up step, as a new user would have run
# Its end checkpoint is written in the background from a copy of the state (128 MiB): on a busy
# machine still in memory here, and freed under the cap, which the step would then fit in.
from autotune.run_folder.checkpoint_files import wait_for_writes
wait_for_writes()
before = {k: v.clone() for k, v in model.state_dict().items()}
cap_address_space(60 * 2**20)
try:
    trainer.fit(max_steps=4)
    error = None
except OutOfMemory as exc:
    error = "OutOfMemory: " + str(exc)
except Exception as exc:
    error = type(exc).__name__ + ": " + str(exc)
lift_address_space_cap()
after = model.state_dict()
save({"error": error, "same_keys": sorted(before) == sorted(after),
      "same_weights": all(k in after and after[k].shape == v.shape and torch.equal(after[k], v) for k, v in before.items()),
      "shapes": [list(p.shape) for p in model.parameters()], "step": trainer.step})
"""


@pytest.mark.parametrize("isa", [None, "SSE41"])
def test_a_relief_that_runs_out_of_memory_ends_in_out_of_memory_with_the_model_untouched(tmp_path, isa):
    run_dir = tmp_path / "run"
    proc, result = run_python(f"RUN_DIR = {str(run_dir)!r}\n" + SCRIPT, tmp_path, timeout=240,
                              env={"ONEDNN_MAX_CPU_ISA": isa} if isa else None)
    assert proc.returncode == 0 and result is not None, (proc.returncode, proc.stderr[-3000:])  # -11: SIGSEGV
    assert result["error"] and result["error"].startswith("OutOfMemory: out of memory on cpu even at micro-batch 1"), \
        result["error"]
    assert "RLIMIT_AS" in result["error"]  # the memory figures
    assert result["shapes"] == [[8192, 4096], [8192], [10, 8192], [10]]
    assert result["same_keys"] and result["same_weights"], result
    records = journal(run_dir)
    failed = [r for r in records if r["kind"] == "relief_failed"]
    assert failed, json.dumps([r["kind"] for r in records])
    assert any(r["relief"] == "pruning" and "out of memory" in r["reason"] for r in failed), failed
    assert [r for r in records if r["kind"] == "out_of_memory"]  # journaled before the error
    before = [r for r in records if r["kind"] == "checkpoint" and r["reason"] == "before_relief"]
    assert before and before[0]["step"] == 1  # the last completed step, before the first relief ran
    (autocast,) = [r for r in records if r["kind"] == "relief" and r["relief"] == "autocast"]
    if native_bf16() and torch.backends.mkldnn.is_available() and isa is None:
        assert autocast["note"].startswith("skipped: this CPU has native bf16"), autocast
    assert records[-1]["kind"] == "fit_failed" and "OutOfMemory" in records[-1]["error"]
