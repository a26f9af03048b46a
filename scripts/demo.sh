#!/usr/bin/env bash
# The DDP autoencoder workflow end to end on this machine's CPU (or its GPUs when present):
# sample frames -> 2-process DDP training with CSV/TensorBoard/W&B-offline logs -> ONNX export
# checked by onnxruntime -> scaling table over 1 vs 2 processes and two batch sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
GT=".venv/bin/gputrain"
OUT=runs/demo
rm -rf "$OUT"
export WANDB_SILENT=true

echo "== 1. sample data: 1024 frames of 80x80 in data/frames"
[ -d data/frames ] || $GT data make imagefolder --out data/frames --count 1024

echo "== 2. train the autoencoder with DDP on 2 processes"
$GT train autoencoder --devices 2 --epochs 4 --out "$OUT/train" trainer.loggers=[csv,tensorboard,wandb]

echo "== 3. export to ONNX and check it with onnxruntime"
$GT export onnx --checkpoint "$OUT/train/checkpoints/last.pt" --out "$OUT/autoencoder.onnx"

echo "== 4. scaling table: 1 vs 2 processes at batch 32 and 64 per device"
$GT bench scale autoencoder --devices 1,2 --batch-size 32,64 --epochs 3 --out "$OUT/scale"
