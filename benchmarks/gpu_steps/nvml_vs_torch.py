"""GPU check (a): what NVML sees against what torch's allocator holds.

- The change NVML sees for this process (device used, and per-process bytes where NVML lists
  this PID) matches the change of `memory_reserved` when 1 GiB is allocated.
- Another process's allocation shows as someone else's: in `cuda_reserved_cap`'s "outside"
  figure and NVML's device total, not in this process's reserved bytes.
- The monitor process (autotune.monitor.process) samples the GPU through NVML without a CUDA
  context (no libcuda mapped, not in NVML's list of compute processes); `autotune monitor` runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _step import MiB, Report, cuda_context_free, main, wait_for  # noqa: E402
import torch  # noqa: E402
from autotune.memory.figures import cuda_reserved_cap, cuda_uuid  # noqa: E402
from autotune.monitor.nvml import session  # noqa: E402
from autotune.monitor.process import MonitorProcess  # noqa: E402

TOLERANCE = 64 * MiB  # NVML rounds to pages and the driver keeps small bookkeeping of its own

OTHER = """
import sys, torch
x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
"""


def run(report: Report, device) -> None:
    uuid = cuda_uuid(device)
    nvml = session()
    if not report.check("NVML finds the device by torch's UUID", nvml.memory(uuid) is not None, uuid):
        return
    torch.zeros(1, device=device)  # the context first: its memory is not the allocation's
    torch.cuda.synchronize(device)

    def figures():
        torch.cuda.synchronize(device)
        time.sleep(0.2)  # NVML's figures follow the driver's, not the stream
        per_process = nvml.processes(uuid) or {}
        return torch.cuda.memory_reserved(device), nvml.memory(uuid).used_bytes, per_process.get(os.getpid())

    reserved0, used0, mine0 = figures()
    block = torch.empty(1024 * MiB, dtype=torch.uint8, device=device)
    reserved1, used1, mine1 = figures()
    grew = report.figure("reserved grew (MiB)", (reserved1 - reserved0) / MiB)
    seen = report.figure("NVML device used grew (MiB)", (used1 - used0) / MiB)
    report.check("NVML's device figure moves with reserved", abs(seen - grew) * MiB <= TOLERANCE, f"{seen} vs {grew}")
    listed = mine0 is not None and mine1 is not None
    report.figure("NVML lists this PID", listed)
    if listed:
        report.check("NVML's per-process bytes move with reserved", abs(mine1 - mine0 - (reserved1 - reserved0))
                     <= TOLERANCE, f"{(mine1 - mine0) / MiB} vs {grew} MiB")
    else:  # a container: NVML gives the host's PIDs (the monitor says so and leaves the figure unknown)
        report.check("NVML's per-process figure is unknown here, not 0", mine1 is None, mine1)

    cap_before, outside_before = cuda_reserved_cap(device)
    other = subprocess.Popen([sys.executable, "-c", OTHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        report.check("another process allocates 512 MiB", other.stdout.readline().strip() == "ready")
        reserved2, used2, mine2 = figures()
        cap_after, outside_after = cuda_reserved_cap(device)
        report.figure("outside this allocator grew (MiB)", (outside_after - outside_before) / MiB)
        report.check("the other process's memory counts as outside", outside_after - outside_before >= 512 * MiB - TOLERANCE)
        report.check("this process's reserved bytes did not move", reserved2 == reserved1)
        report.check("the room left for this process shrank by as much", cap_before - cap_after >= 512 * MiB - TOLERANCE,
                     f"{(cap_before - cap_after) / MiB} MiB")
        if listed:
            others = nvml.processes(uuid) or {}
            report.check("NVML lists the other process apart", (others.get(other.pid) or 0) >= 512 * MiB - TOLERANCE
                         and abs((mine2 or 0) - mine1) <= TOLERANCE, {k: v for k, v in others.items()})
    finally:
        other.stdin.write("\n")
        other.stdin.flush()
        other.wait(timeout=30)
    del block

    with tempfile.TemporaryDirectory() as folder:
        monitor = MonitorProcess(Path(folder), interval=0.1, gpu_uuid=uuid)
        monitor.start()
        try:
            got = wait_for(monitor.latest, 20)
            report.check("the monitor process samples the GPU", got is not None and got[0].used_bytes is not None,
                         got)
            report.check("the monitor process has no CUDA context (no libcuda mapped)", cuda_context_free(monitor.pid))
            if listed:
                report.check("NVML does not list the monitor as a compute process",
                             monitor.pid not in (nvml.processes(uuid) or {}))
        finally:
            monitor.stop()
        out = Path(folder) / "daemon.jsonl"
        daemon = subprocess.run([sys.executable, "-m", "autotune.cli", "monitor", "--duration", "2", "--interval",
                                 "0.2", "--out", str(out), "--no-view", "--pid", str(os.getpid())],
                                capture_output=True, text=True, timeout=60)
        lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        gpus = [line for line in lines if line.get("device") == "gpu" and line.get("used_bytes")]
        report.check("autotune monitor writes GPU samples", daemon.returncode == 0 and len(gpus) >= 2,
                     f"rc {daemon.returncode}, {len(gpus)} GPU samples; {daemon.stderr[-300:]}")


if __name__ == "__main__":
    main(run)
