#!/usr/bin/env bash
# `make gpu-check`: on a CUDA machine, the gpu-marked tests plus a short GPU timing.
# Uses the machine's python3 (GPU machines bring torch with CUDA). Packages it lacks
# may come as wheels in .whl/ (see DEVELOPERS notes); they go to a private target dir.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/autotune-site .whl/*.whl
  export PYTHONPATH=/tmp/autotune-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import torch; assert torch.cuda.is_available(), 'gpu-check needs a CUDA device'; print('GPU:', torch.cuda.get_device_name(0))"
# Each part runs even when one before it failed (a device lease is short: one run tells all).
failed=()
part() {
  local name=$1; shift
  echo "== $name"
  "$@" || failed+=("$name")
}
part "gpu-marked tests" $PY -m pytest -q -m gpu tests -p no:cacheprovider -o faulthandler_timeout=240
part "GPU timing" $PY benchmarks/gpu_timing.py
part "steady step on CUDA" $PY benchmarks/gpu_steady_step.py
part "demo on CUDA" $PY -m autotune.cli demo --device cuda --samples 4096 --batch-size 4096 --budget-mib 1024 \
  --epochs 1 --no-progress
if ((${#failed[@]})); then
  echo "gpu-check: failed: ${failed[*]}"
  exit 1
fi
echo "gpu-check: all parts passed"
