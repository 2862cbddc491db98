"""GPU timing (the GPU check's step i): AutoTrainer against a plain loop on CUDA, split into
what a user waits for: the time to the first completed step (set-up included), the steady
step, and what the end of a fit costs; and a capped run that really runs out of memory, so
recovery on CUDA has its row.

MLP 512-8192-8192-16, AdamW, 16 batches of 4096 a fit (an epoch). The capped run's cap is the
weights and their AdamW state and gradients plus half of what the whole batch's step needs
beyond them, measured uncapped here: the whole batch cannot fit.

    python benchmarks/gpu_timing.py      # alone: writes benchmarks/results/gpu_timing.md
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "gpu_steps"))
from _step import MiB, Report, main  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from autotune import AutoTrainer  # noqa: E402
from autotune.data.sampler import EpochSampler  # noqa: E402

SAMPLES, FEATURES, WIDTH, CLASSES, BATCH = 65536, 512, 8192, 16, 4096
ROUNDS = 3
CAP_FIGURE = "capped run: what stays, what the whole batch's step needs beyond, the cap (MiB)"
OOM_FIGURE = "capped run: OOMs, same-size retries, final micro-batch"


def run(report: Report, device) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))

    def make_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                             nn.Linear(WIDTH, CLASSES)).to(device)

    def split(start: float, stamps: list[float], end: float) -> dict[str, float]:
        steps = [b - a for a, b in zip(stamps[2:], stamps[3:])]
        return {"first step": stamps[0] - start, "steady step": statistics.median(steps),
                "end of fit": end - stamps[-1], "whole": end - start}

    def plain() -> dict[str, float]:
        torch.cuda.synchronize(device)
        start, stamps = time.perf_counter(), []
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = DataLoader(data, batch_size=BATCH, sampler=EpochSampler(len(data), seed=0), pin_memory=True)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())
        return split(start, stamps, time.perf_counter())

    def auto(cap: int | None = None) -> tuple[dict[str, float], object, list]:
        torch.cuda.synchronize(device)
        start, stamps = time.perf_counter(), []

        class Stamp:
            def on_step_end(self, trainer):
                torch.cuda.synchronize(device)
                stamps.append(time.perf_counter())

        with tempfile.TemporaryDirectory() as folder:
            trainer = AutoTrainer(make_model(), data, loss_fn=nn.functional.cross_entropy, batch_size=BATCH,
                                  device=device, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), memory_cap=cap,
                                  progress=False, run_dir=folder, callbacks=[Stamp()])
            try:
                result = trainer.fit(epochs=1)
                torch.cuda.synchronize(device)
                end = time.perf_counter()
            finally:
                trainer.close()
                torch.cuda.set_per_process_memory_fraction(1.0, device)
            from autotune.observe.journal import read_journal

            kinds = [r["kind"] for r in read_journal(Path(folder) / "events.jsonl")]
        return split(start, stamps, end), result, kinds

    plain(), auto()  # warm: kernels, cuBLAS handles, torch._dynamo's import
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "autotune": []}
    for _ in range(ROUNDS):
        rows["plain"].append(plain())
        rows["autotune"].append(auto()[0])

    # The capped run: what the whole batch's step needs above what stays, measured uncapped.
    torch.cuda.empty_cache()
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = data.tensors[0][:BATCH].to(device), data.tensors[1][:BATCH].to(device)
    for _ in range(2):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    stays = torch.cuda.memory_allocated(device) - x.nbytes - y.nbytes
    torch.cuda.reset_peak_memory_stats(device)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    need = torch.cuda.max_memory_reserved(device) - stays
    del model, optimizer, x, y
    torch.cuda.empty_cache()
    cap = stays + need // 2
    report.figure(CAP_FIGURE,
                  (stays // MiB, need // MiB, cap // MiB))
    capped, capped_result, kinds = auto(cap)
    rows["autotune, capped"] = [capped]

    base = {key: statistics.median(r[key] for r in rows["plain"]) for key in rows["plain"][0]}
    table = ["| loop | first step (s) | steady step (ms) | ratio | end of fit (s) | whole fit (s) | ratio |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, values in rows.items():
        m = {key: statistics.median(r[key] for r in values) for key in values[0]}
        table.append(f"| {name} | {m['first step']:.3f} | {m['steady step'] * 1e3:.2f} | "
                     f"{m['steady step'] / base['steady step']:.3f} | {m['end of fit']:.3f} | {m['whole']:.3f} | "
                     f"{m['whole'] / base['whole']:.3f} |")
        report.figure(f"{name}: steady step over plain", round(m["steady step"] / base["steady step"], 3))
    report.figure("table", "\n".join(table))
    report.figure(OOM_FIGURE,
                  (capped_result.ooms, kinds.count("oom_retry"), capped_result.micro_batch_size))
    report.check("the capped run really ran out of memory, and finished", capped_result.ooms >= 1
                 and capped_result.samples_seen == SAMPLES, capped_result)
    write_results_if_alone(report, torch.cuda.get_device_name(device))


def write_results_if_alone(report: Report, gpu: str) -> None:
    if report.path is not None:
        return  # the GPU check writes its own results
    from common import write_results

    write_results("gpu_timing", "GPU timing: AutoTrainer vs a plain loop (CUDA)", [
        f"{gpu}; MLP {FEATURES}-{WIDTH}-{WIDTH}-{CLASSES}, AdamW, {SAMPLES} samples, batch {BATCH}, one epoch a "
        f"fit, {ROUNDS} rounds (medians). First step: from before the model is built to the end of the first "
        "optimizer step. End of fit: from the last step to fit's return (the end checkpoint).", "",
        report.figures["table"], "",
        f"{CAP_FIGURE}: {report.figures[CAP_FIGURE]}; {OOM_FIGURE}: {report.figures[OOM_FIGURE]}."])


if __name__ == "__main__":
    main(run)
