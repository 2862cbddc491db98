"""GPU check (c): allocator pressure, real, reaches the pressure detector and empty_cache.

- A real allocator retry: the cache full of 64 MiB blocks under the per-process fraction, then
  a 512 MiB request no cached block serves: the allocator frees its cache and retries
  (`num_alloc_retries` grows). MEMORY_PRESSURE reaches a policy; empty_cache_on_pressure acts.
- Real fragmentation: one 2 GiB segment split into 200 MiB blocks, every other one freed (the
  freed halves cannot go back to the device: their segment is in use). MEMORY_PRESSURE again,
  with `inactive_split_bytes` in the snapshot.
- `empty_cache` returns what its journal line says: a known 1 GiB cache, the note against the
  reserved bytes that went.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).parent))
from _step import MiB, Report, main  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from autotune import Event, Tuner  # noqa: E402
from autotune.common.actions import EmptyCache  # noqa: E402
from autotune.observe.journal import read_journal  # noqa: E402
from autotune.decisions.knobs import Knobs, apply  # noqa: E402
from autotune.tuning import monitor_link as link  # noqa: E402
from autotune.policies import EmptyCacheOnPressure  # noqa: E402
from autotune.common.units import parse_bytes  # noqa: E402

CAP = 4096 * MiB


def run(report: Report, device) -> None:
    @dataclasses.dataclass
    class Heard:
        name: ClassVar[str] = "heard"
        events: ClassVar[frozenset] = frozenset({Event.MEMORY_PRESSURE})
        seen: list = dataclasses.field(default_factory=list)

        def decide(self, event, snap):
            self.seen.append(snap.allocator)
            return []

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            return None

    link.START_AFTER_S = 0.0  # the monitor's samples from the first step: fragmentation is judged on them
    heard = Heard()
    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    x, y = torch.randn(32, 64, device=device), torch.randint(0, 8, (32,), device=device)
    held: list = []

    def plain(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    with tempfile.TemporaryDirectory() as folder, Tuner(
            model, lambda p: torch.optim.SGD(p, lr=0.1), device=device, memory_cap=CAP, run_dir=folder,
            monitor_interval=0.05, policies=[EmptyCacheOnPressure(threshold=0.5, cooldown_steps=1), heard]) as tuner:
        for _ in range(5):
            tuner.step((x, y), plain)
            time.sleep(0.05)
        retries_before = torch.cuda.memory_stats(device)["num_alloc_retries"]
        blocks = []
        while torch.cuda.memory_reserved(device) + 128 * MiB < CAP:
            blocks.append(torch.empty(64 * MiB, dtype=torch.uint8, device=device))
        del blocks  # all cached now
        big = torch.empty(512 * MiB, dtype=torch.uint8, device=device)
        del big
        retries = torch.cuda.memory_stats(device)["num_alloc_retries"] - retries_before
        report.check("a real allocator retry", retries >= 1, f"{retries} retries")
        for _ in range(40):  # the next measured step sees it (cadence.py)
            tuner.step((x, y), plain)
            if heard.seen:
                break
        report.check("the retry reached MEMORY_PRESSURE", bool(heard.seen) and heard.seen[-1].num_alloc_retries >= 1,
                     heard.seen[-1] if heard.seen else "not heard in 40 steps")
        heard.seen.clear()
        torch.cuda.empty_cache()
        size = int(0.95 * CAP) - torch.cuda.memory_reserved(device)
        segment = torch.empty(size, dtype=torch.uint8, device=device)
        del segment  # one cached segment, split below
        parts = [torch.empty(size // 10 - 2 * MiB, dtype=torch.uint8, device=device) for _ in range(10)]
        held.extend(parts[1::2])
        del parts
        stats = torch.cuda.memory_stats(device)
        report.figure("fragments (inactive split, MiB)", stats["inactive_split_bytes.all.current"] // MiB)
        for _ in range(150):  # 3 s at most: the monitor's samples (it started at the first step) judge it
            tuner.step((x, y), plain)
            time.sleep(0.02)
            if heard.seen:
                break
        report.check("fragmentation reached MEMORY_PRESSURE", bool(heard.seen) and
                     heard.seen[-1].inactive_split_bytes > 0, heard.seen[-1] if heard.seen else "not heard in 150 steps")
        held.clear()
        records = list(read_journal(Path(folder) / "events.jsonl"))
        acted = [r for r in records if r["kind"] == "action" and r["policy"] == "empty_cache_on_pressure"]
        report.check("empty_cache_on_pressure acted", len(acted) >= 1, [r.get("note") for r in acted])

    torch.cuda.empty_cache()
    cache = torch.empty(1024 * MiB, dtype=torch.uint8, device=device)
    del cache
    before = torch.cuda.memory_reserved(device)
    outcome = apply(EmptyCache(reason="check"), Knobs(batch_size=1, micro_batch_size=1, device=device))
    went = before - torch.cuda.memory_reserved(device)
    said = re.search(r"returned (.+)$", outcome.note)
    report.figure("empty_cache: journal says / reserved went", (outcome.note, f"{went / MiB:.0f} MiB"))
    report.check("empty_cache returns what its journal line says", said is not None and
                 abs(parse_bytes(said.group(1).replace(" ", "")) - went) <= max(16 * MiB, 0.05 * went))  # its 3 digits


if __name__ == "__main__":
    main(run)
