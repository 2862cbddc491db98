"""autotune's own microseconds a step, where nothing hides them: `Tuner.step` on a tiny model against a
hand loop that does the same NaN/inf check, stepped in turn (the order alternating), 20,000 pairs.

    PYTHONPATH=<a checkout> python benchmarks/tiny_step.py [pairs]

Prints the medians and their difference ("own"): a probe for A/B runs of two checkouts on one machine
(the figures of issue 46 are in benchmarks/results/steady_step_issue46.md). Model: Linear(8, 16), ReLU,
Linear(16, 1), batch 16, SGD, one torch thread, the default policies and the monitor on.
"""

import statistics
import sys
import tempfile
import time

import torch

from autotune import Tuner
from autotune.step.finite import all_finite


def main(pairs: int = 20000) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)

    def model_and_optimizer():
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    x, y = torch.randn(16, 8), torch.randn(16, 1)
    loss_fn = torch.nn.functional.mse_loss
    hand_model, hand_optimizer = model_and_optimizer()
    tuned_model, tuned_optimizer = model_and_optimizer()

    def hand() -> None:
        loss_fn(hand_model(x), y).backward()
        if all_finite([p.grad for p in hand_model.parameters() if p.grad is not None]):
            hand_optimizer.step()
        hand_optimizer.zero_grad(set_to_none=True)

    with tempfile.TemporaryDirectory() as run_dir, \
            Tuner(tuned_model, tuned_optimizer, loss_fn=loss_fn, run_dir=run_dir, device="cpu") as tuner:
        for _ in range(500):  # warm-up
            hand()
            tuner.step((x, y))
        hands, tuned = [], []
        for i in range(pairs):
            for side in (("hand", "tuner") if i % 2 else ("tuner", "hand")):
                start = time.perf_counter()
                hand() if side == "hand" else tuner.step((x, y))
                (hands if side == "hand" else tuned).append(time.perf_counter() - start)
    hand_us, tuner_us = statistics.median(hands) * 1e6, statistics.median(tuned) * 1e6
    print(f"hand+check {hand_us:.1f} us  tuner {tuner_us:.1f} us  own {tuner_us - hand_us:.1f} us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000)
