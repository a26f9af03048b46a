#!/usr/bin/env bash
# CUDA tests and GPU benchmarks on a lent GPU machine (python3 there has torch; wheels for what it
# lacks travel in .whl/). Results go to $OUT (or runs/gpu). Usage: bash scripts/gpu_check.sh [tests|bench|recipes]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1 WANDB_SILENT=true
nvidia-smi -L; python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
for part in "${@:-tests bench}"; do
  case $part in
    tests)
      python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.log" ;;
    bench)
      python3 benchmarks/overhead.py --accelerator cuda --pairs 5 --json "$OUT/overhead_cuda.json" 2>&1 | grep -v "^gputrain:"
      [ -d /tmp/frames ] || python3 -m gputrain data make imagefolder --out /tmp/frames --count 12944 >/dev/null
      python3 -m gputrain bench scale autoencoder --devices 1 --batch-size 64,128 --epochs 4 --accelerator cuda \
        --out "$OUT/scale" data.root=/tmp/frames data.num_workers=6 ;;
    recipes)
      python3 benchmarks/recipes.py --accelerator cuda --json "$OUT/recipes_cuda.json" 2>&1 | tail -20 ;;
  esac
done
