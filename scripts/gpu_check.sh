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
      # Each built-in recipe on one GPU with its own precision, on generated data, 3 epochs.
      D=/tmp/gpudata; GT="python3 -m gputrain"
      [ -d $D/cifar10 ] || $GT data make cifar10 --out $D/cifar10 --count 12000 >/dev/null
      [ -d $D/ade20k ] || $GT data make ade20k --out $D/ade20k --count 240 --size 256 >/dev/null
      [ -d $D/coco ] || $GT data make coco --out $D/coco --count 120 --size 256 >/dev/null
      [ -d $D/classes ] || $GT data make classfolder --out $D/classes --count 2000 --size 128 >/dev/null
      R=/tmp/gpuruns  # checkpoints of ResNet-50/DeepLab/Mask R-CNN are large: keep them off $OUT
      common="--accelerator cuda --epochs 3 trainer.progress_bar=false data.num_workers=6 trainer.checkpoint_every_n_epochs=0"
      $GT train cifar10-resnet18 $common --data-root $D/cifar10 --batch-size 256 --out $R/r_cifar10 2>&1 | grep "epoch 3"
      $GT train imagefolder-resnet50 $common --data-root $D/classes --batch-size 64 data.image_size=128 --out $R/r_resnet50 2>&1 | grep "epoch 3"
      $GT train ade20k-deeplabv3plus $common --data-root $D/ade20k --batch-size 16 data.image_size=256 data.num_classes=8 --out $R/r_deeplab 2>&1 | grep "epoch 3"
      $GT train coco-maskrcnn $common --data-root $D/coco --batch-size 8 --out $R/r_maskrcnn 2>&1 | grep "epoch 3"
      python3 benchmarks/summarize_runs.py $R/r_cifar10 $R/r_resnet50 $R/r_deeplab $R/r_maskrcnn | tee $OUT/recipes_cuda.md ;;
  esac
done
