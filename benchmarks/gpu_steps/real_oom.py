"""GPU check (b): real CUDA OOMs, one in forward and one in backward, under
`set_per_process_memory_fraction`, recovered with the weights of the uncapped run.

For each case: where the OOM struck (forward: inside the step function; backward: after it
returned), the allocator's own `num_ooms` equal to autotune's count, a smaller size at once (the
whole batch never fit: no same-size retry), and nothing left allocated between batches (the memory held
after each optimizer step is the same after a batch that failed as after one that did not).
The driver runs it again with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _step import MiB, Report, main  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from autotune import AutoTrainer  # noqa: E402
from autotune.observe.journal import read_journal  # noqa: E402

SAMPLES, FEATURES, WIDTH, CLASSES, BATCH = 16384, 256, 16384, 8, 2048


def run(report: Report, device) -> None:
    report.figure("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES)).to(device)

    # What the whole batch needs above the weights, measured uncapped: through forward, and the whole step.
    probe = model()
    x, y = data.tensors[0][:BATCH].to(device), data.tensors[1][:BATCH].to(device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = nn.functional.cross_entropy(probe(x), y)
    forward_need = torch.cuda.max_memory_allocated(device) - base
    loss.backward()
    step_need = torch.cuda.max_memory_allocated(device) - base
    del probe, x, y, loss
    report.figure("whole batch: forward needs (MiB)", round(forward_need / MiB))
    report.figure("whole batch: forward and backward need (MiB)", round(step_need / MiB))

    def fit(run_dir: Path, above_weights: int | None):
        net = model()
        entered, returned, held = [], [], []

        def step(m, batch):
            entered.append(1)
            out = nn.functional.cross_entropy(m(batch[0]), batch[1])
            returned.append(1)
            return out

        class Held:
            def on_step_end(self, trainer):
                torch.cuda.synchronize(device)
                held.append(torch.cuda.memory_allocated(device))

        trainer = AutoTrainer(net, data, step_fn=step, batch_size=BATCH, device=device, progress=False,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.01), run_dir=run_dir, callbacks=[Held()])
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        if above_weights is not None:
            cap = torch.cuda.memory_reserved(device) + above_weights
            torch.cuda.set_per_process_memory_fraction(cap / total, device)
        ooms_before = torch.cuda.memory_stats(device).get("num_ooms", 0)
        try:
            result = trainer.fit(epochs=1)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        allocator_ooms = torch.cuda.memory_stats(device)["num_ooms"] - ooms_before
        trainer.close()
        records = list(read_journal(run_dir / "events.jsonl"))
        weights = {k: v.detach().cpu() for k, v in net.state_dict().items()}
        return result, weights, allocator_ooms, len(entered) - len(returned), held, records

    with tempfile.TemporaryDirectory() as folder:
        free, free_weights, *_ = fit(Path(folder) / "free", None)
        cases = {"forward": int(0.6 * forward_need), "backward": (forward_need + step_need) // 2}
        for phase, above in cases.items():
            result, weights, allocator_ooms, in_forward, held, records = fit(Path(folder) / phase, above)
            kinds = [r["kind"] for r in records]
            report.figure(f"{phase}: cap above the weights (MiB)", round(above / MiB))
            report.figure(f"{phase}: OOMs (autotune / allocator / in forward)", (result.ooms, allocator_ooms, in_forward))
            report.figure(f"{phase}: micro-batch at the end", result.micro_batch_size)
            report.check(f"{phase}: a real OOM was survived", result.ooms >= 1 and result.samples_seen == free.samples_seen)
            where = in_forward if phase == "forward" else result.ooms - in_forward
            report.check(f"{phase}: the first OOM struck in {phase}", where >= 1, f"{in_forward} of {result.ooms} in forward")
            report.check(f"{phase}: the allocator's num_ooms equals autotune's count", allocator_ooms == result.ooms,
                         f"{allocator_ooms} vs {result.ooms}")
            # The whole batch never completed: too large, not unlucky; no same-size retry, a smaller size.
            decisions = [k for k in kinds if k in ("oom", "oom_retry", "action")]
            report.check(f"{phase}: no same-size retry at a size that never fit, a smaller size",
                         decisions[:2] == ["oom", "action"], decisions[:6])
            spread = (max(held[1:]) - min(held[1:])) if len(held) > 2 else 0
            report.check(f"{phase}: nothing left allocated between batches", spread <= MiB,
                         f"allocated after each step (MiB): {[round(h / MiB, 1) for h in held]}")
            worst = max((weights[k] - free_weights[k]).abs().max().item() for k in weights)
            report.figure(f"{phase}: largest weight difference to the uncapped run", worst)
            report.check(f"{phase}: the weights of the uncapped run", all(
                torch.allclose(weights[k], free_weights[k], rtol=1e-4, atol=1e-5) for k in weights))


if __name__ == "__main__":
    main(run)
