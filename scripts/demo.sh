#!/usr/bin/env bash
# The DDP autoencoder workflow end to end on this machine's CPU (or its GPUs when present):
# sample frames -> 2-process DDP training with CSV (+ TensorBoard/W&B-offline when installed) logs ->
# ONNX export checked by onnxruntime -> scaling table over 1 vs 2 processes and two batch sizes.
# On a core install (no extras) the optional steps say what to install instead of failing.
set -euo pipefail
cd "$(dirname "$0")/.."
GT=".venv/bin/gputrain"
PY=".venv/bin/python"
OUT=runs/demo
rm -rf "$OUT"
export WANDB_SILENT=true
have() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

echo "== 1. sample data: 1024 frames of 80x80 in data/frames"
[ -d data/frames ] || $GT data make imagefolder --out data/frames --count 1024

LOGGERS=csv
have tensorboard && LOGGERS="$LOGGERS,tensorboard"
have wandb && LOGGERS="$LOGGERS,wandb"
echo "== 2. train the autoencoder with DDP on 2 processes (loggers: $LOGGERS)"
$GT train autoencoder --devices 2 --epochs 4 --out "$OUT/train" "trainer.loggers=[$LOGGERS]"

echo "== 3. export to ONNX and check it with onnxruntime"
if have onnx && have onnxruntime && have onnxscript; then
  $GT export onnx --checkpoint "$OUT/train/checkpoints/last.pt" --out "$OUT/autoencoder.onnx"
else
  echo "skipped: ONNX export needs the export extra: pip install 'gputrain[export]'"
fi

echo "== 4. scaling table: 1 vs 2 processes at batch 32 and 64 per device"
$GT bench scale autoencoder --devices 1,2 --batch-size 32,64 --epochs 3 --out "$OUT/scale"
