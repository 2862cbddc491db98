"""`make gpu-check`: autotune's CUDA paths on a real card, in one lent slot (issue 45).

Where the package registry is reachable (your own machine, this project's dev machine):

    make gpu-wheels     # .whl/: the wheels a lent GPU machine lacks (loguru, apscheduler, tzlocal, torch-pruning)

On the GPU machine, with its own python and torch (the package accepts torch >= 2.3), `.whl` carried:

    python3 benchmarks/gpu_check.py [--out DIR] [--only a,b] [--budget 470]

Every step runs in its own interpreter with its own time limit (a hung or crashed step costs
only itself), and the whole check keeps to `--budget` seconds. After each step DIR/gpu_check.md
and DIR/gpu_check.json are written again (pass/fail, every check and figure, the versions and
the GPU), so a check cut short keeps what ran. DIR: $OUT where set (the lent machine's folder
that comes back), else benchmarks/results. Packages the machine lacks are installed from the
wheels with `--no-index` into a private folder; one still missing stops the check at once,
named. Without a CUDA device it stops at once and says so; `--dry-run` runs every step's imports
and argument parsing instead, one step after the other in this interpreter (no CUDA needed: the test
suite's CPU dry-run, which pays for torch's import once, not once a step).

Steps (benchmarks/gpu_steps/, each a docstring of what it asserts):
  a  NVML against torch's allocator; another process's memory; the monitor without a CUDA context
  b  real OOMs in forward and in backward under a memory fraction (again with expandable segments)
  c  allocator pressure: a real retry and real fragmentation reach the detector; empty_cache's figure
  d  ResNet-50 under a cap against the largest micro-batch a plain loop fits
  e  the relief ladder: autocast and checkpointing lower the step's peak; pruning frees memory
  f  DDP, two ranks on the one GPU: one rank's OOM agreed, the weights of a clean run
  g  exact resume: the CPU and CUDA random streams, weights bit-equal
  h  the input pipeline: device tensors unpinned, CPU batches pinned, the cache changes no weight
  i  timing: first step, steady step, end of fit; a capped run that really OOMs
  and the gpu-marked tests, the steady step on CUDA, the demo on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS_DIR = Path(__file__).resolve().parent / "gpu_steps"
SITE = Path(tempfile.gettempdir()) / "autotune-gpu-site"

# What autotune and the check import, by module, with the distribution that provides it. A lent GPU
# machine has torch, numpy, psutil, tqdm, matplotlib, nvidia-ml-py and pytest; the first four it lacks.
PACKAGES = {"loguru": "loguru", "apscheduler": "apscheduler", "tzlocal": "tzlocal", "torch_pruning": "torch-pruning",
            "pynvml": "nvidia-ml-py", "psutil": "psutil", "tqdm": "tqdm", "matplotlib": "matplotlib",
            "numpy": "numpy", "torch": "torch", "torchvision": "torchvision", "pytest": "pytest"}
WHEELS = ("loguru", "apscheduler", "tzlocal", "torch-pruning")  # `make gpu-wheels` gathers these


@dataclasses.dataclass
class Step:
    key: str
    title: str
    command: list[str]  # run with this interpreter; "{result}" becomes the step's result file
    limit_s: int
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    dry: list[str] | None = None  # the dry-run's command (default: the command with --dry-run)


def step_script(name: str) -> list[str]:
    return [str(STEPS_DIR / name), "--result", "{result}"]


STEPS = [
    Step("a", "NVML against torch; another process; the monitor", step_script("nvml_vs_torch.py"), 60),
    Step("b", "real OOMs in forward and backward", step_script("real_oom.py"), 90),
    Step("b2", "real OOMs, expandable segments", step_script("real_oom.py"), 90,
         env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    Step("h", "the input pipeline", step_script("input.py"), 45),
    Step("g", "exact resume", step_script("resume.py"), 45),
    Step("c", "allocator pressure", step_script("pressure.py"), 60),
    Step("e", "the relief ladder", step_script("relief.py"), 60),
    Step("f", "DDP, two ranks on one GPU", step_script("ddp.py"), 120),
    Step("d", "ResNet-50 under a cap", step_script("resnet_cap.py"), 150),
    Step("i", "timing", [str(ROOT / "benchmarks" / "gpu_timing.py"), "--result", "{result}"], 120),
    Step("tests", "the gpu-marked tests", ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                            str(ROOT / "tests")], 150,
         dry=["-m", "pytest", "-q", "-m", "gpu", "--collect-only", "-p", "no:cacheprovider", str(ROOT / "tests")]),
    Step("steady", "the steady step on CUDA", [str(ROOT / "benchmarks" / "gpu_steady_step.py"), "--rounds", "5"], 120,
         dry=[str(ROOT / "benchmarks" / "gpu_steady_step.py"), "--help"]),
    Step("demo", "the demo on CUDA", ["-m", "autotune.cli", "demo", "--device", "cuda", "--samples", "4096",
                                      "--batch-size", "4096", "--budget-mib", "1024", "--epochs", "1", "--no-progress"],
         90, dry=["-m", "autotune.cli", "demo", "--help"]),
]


def wheel_specs() -> str:
    """`dist==version` of each wheel a GPU machine lacks, at the versions this environment tests with."""
    return " ".join(f"{dist}=={importlib.metadata.version(dist)}" for dist in WHEELS)


def missing_modules() -> list[str]:
    importlib.invalidate_caches()
    return [module for module in PACKAGES if importlib.util.find_spec(module) is None]


def ensure_packages(wheels: Path) -> tuple[list[str], list[str]]:
    """Install what is missing from `wheels` (no index: the machine reaches none) into a private
    folder put first on the path; (installed wheels, modules still missing)."""
    missing = missing_modules()
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not missing or not found:
        return [], missing
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, found)], check=True,
                   env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"})
    sys.path.insert(0, str(SITE))
    return [wheel.name for wheel in found], missing_modules()


def child_env(extra: dict[str, str]) -> dict[str, str]:
    path = [str(SITE)] if SITE.is_dir() else []
    path += [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1", **extra}


PROBE = """
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if info["cuda_available"]:
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    try:
        import pynvml
        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    except Exception as exc:
        info["driver"] = f"not available ({type(exc).__name__})"
print(json.dumps(info))
"""


def machine() -> dict:
    """The versions and the GPU, read in a child (the check itself never makes a CUDA context: a
    context held here would count in every step's memory figures)."""
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=child_env({}), timeout=120)
    if proc.returncode != 0:
        return {"cuda_available": False, "error": proc.stderr[-800:]}
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        info["autotune"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:
        info["autotune"] = "unknown"
    return info


def run_step(step: Step, limit_s: float) -> dict:
    """One step in its own interpreter (its own process group: torchrun's ranks go with it)."""
    with tempfile.TemporaryDirectory() as folder:
        result_path = Path(folder) / "result.json"
        argv = [sys.executable, *(arg.replace("{result}", str(result_path)) for arg in step.command)]
        started = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=child_env(step.env), start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=limit_s)
            status = "passed" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            status = "timed out"
        return step_record(step, status, proc.returncode, started, argv[1:], output, result_path, limit_s)


def dry_run_here(step: Step) -> dict:
    """A step's dry run (its `dry` command, or its command with --dry-run) in this interpreter, as
    `__main__`: its imports and its argument parsing, nothing on a device."""
    with tempfile.TemporaryDirectory() as folder:
        result_path = Path(folder) / "result.json"
        command = [arg.replace("{result}", str(result_path)) for arg in (step.dry or [*step.command, "--dry-run"])]
        started, output, code = time.monotonic(), io.StringIO(), 0
        saved_argv, saved_path = sys.argv[:], sys.path[:]
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                if command[0] == "-m":
                    sys.argv = [command[1], *command[2:]]
                    runpy.run_module(command[1], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = command
                    sys.path[:0] = [str(Path(command[0]).parent), str(ROOT)]  # as `python script.py` has it
                    runpy.run_path(command[0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except Exception:  # the step's import or parsing failed: its traceback is the record's output
            traceback.print_exc(file=output)
            code = 1
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
        return step_record(step, "passed" if code == 0 else "failed", code, started, command, output.getvalue(),
                           result_path, step.limit_s)


def step_record(step: Step, status: str, returncode: int | None, started: float, command: list[str], output: str,
                result_path: Path, limit_s: float) -> dict:
    """What the report says of a step that ran: its status, its checks and figures (its result file), its output."""
    record = {"key": step.key, "title": step.title, "status": status, "returncode": returncode,
              "seconds": round(time.monotonic() - started, 1), "limit_s": round(limit_s),
              "command": " ".join(command), "env": step.env, "checks": [], "figures": {},
              "output_tail": output[-3000:]}
    if result_path.exists():
        saved = json.loads(result_path.read_text())
        record["checks"], record["figures"] = saved["checks"], saved["figures"]
    if status == "passed" and any(not c["ok"] for c in record["checks"]):
        record["status"] = "failed"
    print(f"== {step.key} {step.title}: {record['status']} ({record['seconds']} s)\n{output[-1500:]}", flush=True)
    return record


def write_report(out: Path, info: dict, records: list[dict], note: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    passed = sum(r["status"] == "passed" for r in records)
    (out / "gpu_check.json").write_text(json.dumps({"machine": info, "steps": records, "note": note}, indent=1,
                                                   default=str))
    lines = ["# GPU check", "",
             f"- command: `python3 benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`".rstrip(),
             f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
             "- machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), ""]
    if note:
        lines += [note, ""]
    if records:
        lines += [f"{passed} of {len(records)} steps passed.", "", "| step | what | status | seconds |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {r['key']} | {r['title']} | {r['status']} | {r['seconds']} |" for r in records]
    for r in records:
        lines += ["", f"## {r['key']}: {r['title']} ({r['status']})", "", f"`{r['command']}`"
                  + (f" with {r['env']}" if r["env"] else ""), ""]
        lines += [f"- {'ok' if c['ok'] else 'FAILED'}: {c['name']}" + (f" ({c['detail'][:400]})" if c["detail"] else "")
                  for c in r["checks"]]
        for name, value in r["figures"].items():
            text = str(value)
            lines += ["", text] if "\n" in text else [f"- {name}: {text[:600]}"]
        if r["status"] != "passed" or not r["checks"]:
            lines += ["", "```", r["output_tail"][-1500:].rstrip(), "```"]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results"))
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels of what the machine lacks")
    parser.add_argument("--only", default="", help="comma-separated step keys (default: all)")
    parser.add_argument("--budget", type=float, default=470.0, help="seconds for the whole check")
    parser.add_argument("--dry-run", action="store_true", help="every step's imports only: no CUDA needed")
    parser.add_argument("--wheel-specs", action="store_true", help="print what `make gpu-wheels` downloads")
    args = parser.parse_args()
    if args.wheel_specs:
        print(wheel_specs())
        return 0
    started = time.monotonic()
    installed, missing = ensure_packages(args.wheels)
    if installed:
        print(f"installed from {args.wheels}: {', '.join(installed)}", flush=True)
    if missing:
        message = (f"gpu-check: this python ({sys.executable}) lacks {', '.join(f'{m} ({PACKAGES[m]})' for m in missing)}"
                   f", and {args.wheels} holds no wheel of it: `make gpu-wheels`, where the package registry is "
                   f"reachable, gathers {', '.join(WHEELS)} into .whl (carry it); torch comes with a GPU machine's "
                   "python")
        write_report(args.out, {"python": sys.version.split()[0]}, [], note=message)
        print(message, file=sys.stderr)
        return 3
    info = machine()
    if not info.get("cuda_available") and not args.dry_run:
        message = (f"gpu-check needs a CUDA device: torch {info.get('torch')} (CUDA {info.get('cuda')}) sees none "
                   f"{info.get('error', '')}".rstrip() + "; `--dry-run` checks the steps' imports without one")
        write_report(args.out, info, [], note=message)
        print(message, file=sys.stderr)
        return 2
    only = {key for key in args.only.split(",") if key}
    unknown = only - {step.key for step in STEPS}
    if unknown:
        parser.error(f"--only: no step {', '.join(sorted(unknown))}; steps: {', '.join(s.key for s in STEPS)}")
    records: list[dict] = []
    chosen = [step for step in STEPS if not only or step.key in only]
    if args.dry_run:  # imports only, nothing on a device: one interpreter imports torch once for all
        records = [dry_run_here(step) for step in chosen]
        write_report(args.out, info, records, "dry run: imports and arguments only, no CUDA")
        chosen = []
    for step in chosen:
        left = args.budget - (time.monotonic() - started)
        if left < 10:
            records.append({"key": step.key, "title": step.title, "status": "not run (budget spent)", "seconds": 0,
                            "command": "", "env": step.env, "checks": [], "figures": {}, "output_tail": ""})
        else:
            records.append(run_step(step, min(step.limit_s, left)))
        write_report(args.out, info, records)
    failed = [r["key"] for r in records if r["status"] != "passed"]
    print(f"gpu-check: {len(records) - len(failed)} of {len(records)} steps passed"
          + (f"; not passed: {', '.join(failed)}" if failed else "") + f"; results in {args.out}/gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
