"""Writes the format-1 checkpoints in this folder, with the code of eb37a61 (the last main whose
checkpoints were one flat dict):

    git worktree add /tmp/eb37 eb37a61
    PYTHONPATH=/tmp/eb37 python tests/checkpoints/make_format1.py tests/checkpoints

`test_checkpoint_format.py` resumes them with today's code and compares with a run that was never
stopped. The run here is `tests.checkpoints.common.run`'s first `STOP_AT` steps.
"""

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import autotune

# common.py from beside this file (autotune from PYTHONPATH: the old tree's)
spec = importlib.util.spec_from_file_location("common", Path(__file__).with_name("common.py"))
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)
STOP_AT, batches, trainer, tuner = common.STOP_AT, common.batches, common.trainer, common.tuner
print("autotune from", autotune.__file__)

out = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as folder:
    with trainer(Path(folder)) as t:
        t.fit(epochs=3, max_steps=STOP_AT)
    newest = sorted((Path(folder) / "checkpoints").glob("step-*.pt"))[-1]
    shutil.copy(newest, out / "format1-autotrainer.pt")
    with tuner(Path(folder) / "tuner") as standalone:
        for batch in batches()[:STOP_AT]:
            standalone.step(batch)
        torch.save(standalone.state_dict(), out / "format1-tuner.pt")
print(sorted(p.name for p in out.glob("format1-*.pt")))
