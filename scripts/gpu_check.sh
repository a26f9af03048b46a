#!/usr/bin/env bash
# CUDA tests and GPU benchmarks on a lent GPU machine (python3 there has torch; wheels for what it
# lacks travel in .whl/). Results go to $OUT (or runs/gpu). Usage: bash scripts/gpu_check.sh [tests|bench|recipes]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if [ -d /tmp/site/omegaconf ]; then  # installed by an earlier part of the same command
  export PYTHONPATH=/tmp/site:$PWD/src
elif ls .whl/*.whl >/dev/null 2>&1; then
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
      python3 benchmarks/overhead.py --accelerator cuda --pairs 5 --json "$OUT/overhead_cuda.json"
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
    fast)
      # Issue 16's GPU figures: ResNet-50 at 224 with each speed option (synthetic data), then the input-bound
      # ratio on ImageNet-like JPEGs (500x375) with the CPU decoding in workers and with nvJPEG on the GPU.
      D=${GPU_DATA:-/tmp/gpudata}; GT="python3 -m gputrain"; R=${GPU_RUNS:-/tmp/gpuruns}
      ACC=${GPU_ACC:-cuda}; SIZE=${SIZE:-224}; BATCH=${BATCH:-256}
      [ -d $D/imagenet-like ] || D=$D PER_CLASS=${PER_CLASS:-1000} python3 scripts/imagenet_like.py
      common="trainer.batch_size=$BATCH data.image_size=$SIZE data.num_workers=auto"
      python3 benchmarks/fast_path.py imagefolder-resnet50 --data-root $D/imagenet-like --epochs 3 \
        --reps "${REPS:-1}" ${EACH:-} $common --json "$OUT/fast_path_resnet50.json" ;;
    input)
      # The input-bound ratio on ImageNet-like JPEGs: decoding in the loader workers, then with nvJPEG.
      D=${GPU_DATA:-/tmp/gpudata}; GT="python3 -m gputrain"; R=${GPU_RUNS:-/tmp/gpuruns}
      ACC=${GPU_ACC:-cuda}; SIZE=${SIZE:-224}; BATCH=${BATCH:-256}
      [ -n "${SKIP_DECODE:-}" ] || python3 benchmarks/data_loading.py --images 128 --size 500x375 --crop 224 --pairs 5 \
        --json "$OUT/decode_per_worker.json" 2>&1 | tail -12
      [ -d $D/imagenet-like ] || D=$D PER_CLASS=${PER_CLASS:-1000} python3 scripts/imagenet_like.py
      common="trainer.batch_size=$BATCH data.image_size=$SIZE data.num_workers=auto"
      for dod in ${DOD:-false true}; do
        $GT bench throughput imagefolder-resnet50 --accelerator "$ACC" --epochs 3 --data-root $D/imagenet-like \
          --out $R/throughput_decode_on_device_$dod --overwrite --json "$OUT/throughput_resnet50_dod_$dod.json" \
          $common data.decode_on_device=$dod
      done ;;
    models)
      # Mask R-CNN R50-FPN at COCO's training scale (shorter side 800, batch 8) and DeepLabv3+ R50 at 512 crops,
      # the recipes' defaults otherwise (bf16 auto for Mask R-CNN, the recipe's 16-mixed for DeepLabv3+).
      D=${GPU_DATA:-/tmp/gpudata}; GT="python3 -m gputrain"; R=${GPU_RUNS:-/tmp/gpuruns}; ACC=${GPU_ACC:-cuda}
      [ -d $D/coco640 ] || [[ " ${MODELS:-maskrcnn deeplab} " != *" maskrcnn "* ]] || $GT data make coco --out $D/coco640 --count "${COCO_COUNT:-400}" --size 640 >/dev/null &
      [ -d $D/ade512 ] || $GT data make ade20k --out $D/ade512 --count "${ADE_COUNT:-640}" --size 512 >/dev/null &
      wait
      [[ " ${MODELS:-maskrcnn deeplab} " == *" maskrcnn "* ]] && $GT bench throughput coco-maskrcnn \
        --accelerator "$ACC" --epochs 3 --data-root $D/coco640 \
        --out $R/throughput_maskrcnn --overwrite --json "$OUT/throughput_maskrcnn.json" \
        trainer.batch_size="${MRCNN_BATCH:-8}" data.num_workers=auto "model.kwargs={${MRCNN_SIZE:-min_size: 800, max_size: 1333}}" \
        trainer.eval_every_n_epochs=1000
      [[ " ${MODELS:-maskrcnn deeplab} " == *" deeplab "* ]] && $GT bench throughput ade20k-deeplabv3plus --accelerator "$ACC" --epochs 3 --data-root $D/ade512 \
        --out $R/throughput_deeplab --overwrite --json "$OUT/throughput_deeplab.json" \
        trainer.batch_size="${DL_BATCH:-16}" data.num_classes=8 data.image_size=512 data.num_workers=auto \
        trainer.eval_every_n_epochs=1000 ;;
  esac
done
