"""GPU check (g): exact resume on CUDA. A model with dropout (the CUDA random stream) on a shuffled
loader (the CPU one): a run stopped at step 5 and resumed from its checkpoint ends with weights
bit-equal to the run that was never stopped; so does the CUDA random state at the end.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: the same sums each run
sys.path.insert(0, str(Path(__file__).parent))
from _step import Report, main  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from autotune import AutoTrainer  # noqa: E402


def run(report: Report, device) -> None:
    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 32, generator=g), torch.randint(0, 4, (512,), generator=g))

    def trainer(run_dir: Path) -> AutoTrainer:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 4))
        return AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=32, device=device,
                           progress=False, run_dir=run_dir, checkpoint_interval=None,
                           optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))

    def weights(t: AutoTrainer) -> dict:
        return {k: v.detach().cpu().clone() for k, v in t.model.state_dict().items()}

    with tempfile.TemporaryDirectory() as folder:
        whole = trainer(Path(folder) / "whole")
        whole.fit(epochs=2)
        whole_weights, whole_cuda_rng = weights(whole), torch.cuda.get_rng_state(device)
        whole.close()

        first = trainer(Path(folder) / "stopped")
        first.fit(epochs=2, max_steps=5)
        first.close()
        torch.manual_seed(1234)  # the streams moved on: a resume must restore them, not inherit them
        torch.cuda.manual_seed(1234)
        resumed = trainer(Path(folder) / "stopped")
        result = resumed.fit(epochs=2, resume=True)
        resumed_weights, resumed_cuda_rng = weights(resumed), torch.cuda.get_rng_state(device)
        resumed.close()
    report.check("the resumed run trained the rest", result.samples_seen == 2 * 512, result.samples_seen)
    report.check("weights bit-equal to the uninterrupted run",
                 all(torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights),
                 max((whole_weights[k] - resumed_weights[k]).abs().max().item() for k in whole_weights))
    report.check("the CUDA random state at the end is the uninterrupted run's", torch.equal(whole_cuda_rng,
                                                                                           resumed_cuda_rng))


if __name__ == "__main__":
    main(run)
