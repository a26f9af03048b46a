#!/usr/bin/env bash
# The GPU checklist: what a lent GPU machine must show, run in the order that tells the most first if the lease
# runs out. python3 there has torch; wheels for what it lacks travel in .whl/ and are installed to /tmp/site.
#
#   bash scripts/gpu_check.sh                  # the whole checklist: stack, tests, recipes, images
#   bash scripts/gpu_check.sh tests images     # some parts; a recipe's name runs that recipe's check alone
#
#   stack    versions, and a JPEG encoded and decoded by TorchCodec on the CPU and the GPU (every data set needs it)
#   tests    the CUDA-marked tests (pytest -m cuda); failed when a test fails or none ran
#   recipes  every built-in recipe (src/gputrain/recipes/*.yaml) for $EPOCHS epochs on generated data, with its
#            own precision and at its real input size: ResNet-50 at 224 on 500x375 JPEGs, DeepLabv3+ on 512 crops
#            (twice: the recipe's mixed, then 16-mixed, every step logged with the loss scale), Mask R-CNN at COCO's
#            training scale (shorter side 800); images/s and peak memory of each
#   images   ResNet-50 images/s on real JPEGs and on synthetic data (gputrain bench throughput), decoding in the
#            loader workers, then on the GPU (data.decode_on_device=true)
#   plan     not in the whole list (a lease of its own): for every built-in recipe, at the recipes' settings,
#            `gputrain plan --devices 1`, then each plan that fits trained for $PLAN_STEPS steps against its own
#            predictions (trainer.measure_memory=true): peak memory within 10 % of what the run measures
#            (torch.cuda.max_memory_allocated), step time within 20 %, and the plan's input line not refuted by the
#            steps' data waits (scripts/gpu_checklist_plan.py); plan:NAME plans one recipe
#
# Each check writes its figures and verdict as JSON to $OUT/checks/ (scripts/gpu_checklist.py) and its output to
# $OUT/logs/. At the end the script prints one markdown table of every check in $OUT (also $OUT/checklist.md) and
# exits 1 when a check failed: a run that ended non-zero or logged a NaN/inf loss, or a failed CUDA test (2: an unknown
# part, before anything runs).
# Data sets and run folders stay on the machine ($GPU_DATA, $GPU_RUNS): made once, reused by later commands.
#
# Time: about 15 minutes for the whole list on an H100/H200 (estimated from earlier GPU runs, not yet timed as one).
# A lease is 15 minutes of device time in all, the machine's start included, and one command at most 10 minutes:
# first `bash scripts/gpu_wheels.sh` here (the machine's Python lacks TorchCodec, OmegaConf and pycocotools), then
# one command that carries .whl and puts the open questions first, stopping new checks at BUDGET_S seconds:
#   BUDGET_S=420 EPOCHS=2 bash scripts/gpu_check.sh stack tests ade20k-deeplabv3plus images imagefolder-resnet50 coco-maskrcnn
# (docs/testing.md). Checks not started for the budget get a "skipped: not started" row; a command cut off by its
# time limit keeps the checks it finished in $OUT/checks, and `python3 scripts/gpu_checklist.py table OUT ...`
# prints the table of several commands' folders.
#
# Settings (environment; defaults in brackets): GPU_ACC [cuda], PYTHON [python3], BUDGET_S (no check starts after
# this many seconds; 0: no limit) [0], SPENT_S (seconds of the budget an earlier command of the lease spent) [0],
# EPOCHS [3], PLAN_STEPS (steps of each plan's run in the plan part) [22], WORKERS
# (data.num_workers) [auto], GPU_ARGS (overrides added to every run, e.g. trainer.log_every_n_steps=1 to see where a
# NaN begins) [none],
# counts of generated images FRAMES_COUNT [2000], CIFAR_COUNT [12000], PER_CLASS (JPEGs per class, 10 classes)
# [1000], ADE_COUNT [640], COCO_COUNT [400], MP_COUNT [1000]; sizes RESNET_SIZE [224], ADE_SIZE [512],
# COCO_SIZE (generated) [640], COCO_MIN/COCO_MAX (Mask R-CNN's resize) [800/1333], MP_SIZE [64]; BATCH (images) [256].
# On a CPU, as a smoke test of this script: GPU_ACC=cpu with tiny sizes (tests/e2e/test_gpu_check.py); the
# CUDA-only checks then get a "skipped: no GPU" row.
#
# Other GPU measurements, not in the checklist, which print their own figures: fast (ResNet-50 with each speed
# option, benchmarks/fast_path.py), bench (trainer overhead and scaling of the autoencoder).
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS=${SPENT_S:-0}  # bash counts on from here: the budget's clock
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python3}
# The cheapest recipes first, so that a lease cut short still has most of the rows; then any recipe added since,
# which gets a failed row until run_recipe knows its data.
RECIPES="autoencoder cifar10-resnet18 cifar10-resnet18-recipe imagefolder-resnet50 imagenet-resnet50-v2 resnet50-model-parallel ade20k-deeplabv3plus coco-maskrcnn"
for f in src/gputrain/recipes/*.yaml; do
  [[ " $RECIPES " == *" $(basename "$f" .yaml) "* ]] || RECIPES="$RECIPES $(basename "$f" .yaml)"
done
PARTS=${*:-stack tests recipes images}
for part in $PARTS; do  # every name is checked before anything runs
  [[ " stack tests recipes images plan fast bench $RECIPES " == *" ${part#plan:} "* ]] && continue
  echo "gpu_check.sh: no part $part; parts: stack tests recipes images plan fast bench, or a recipe (plan:RECIPE" \
    "plans one): $RECIPES" >&2
  exit 2
done
mkdir -p "$OUT/logs"
# Found, not imported: importing torchcodec imports torch, seconds per command on a busy machine (stack decodes a JPEG)
if $PY -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('omegaconf', 'pycocotools', 'torchcodec'))))" \
    2>/dev/null; then  # this Python has them all
  export PYTHONPATH=$PWD/src
elif [ -d /tmp/site/omegaconf ]; then  # installed by an earlier command on the same machine
  export PYTHONPATH=/tmp/site:$PWD/src
elif ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1 WANDB_SILENT=true
ACC=${GPU_ACC:-cuda}; EPOCHS=${EPOCHS:-3}; WORKERS=${WORKERS:-auto}; GPU_ARGS=${GPU_ARGS:-}
D=${GPU_DATA:-/tmp/gpudata}; R=${GPU_RUNS:-/tmp/gpuruns}  # ResNet-50 and Mask R-CNN checkpoints are large: not in $OUT
RESNET_SIZE=${RESNET_SIZE:-224}; PER_CLASS=${PER_CLASS:-1000}
JPEGS=$D/jpegs-$PER_CLASS/imagenet-like  # the data's sizes are in its folder's name: other sizes, other folder
mkdir -p "$D" "$R"
[ "$ACC" != cuda ] || nvidia-smi -L
$PY -c "from importlib.metadata import version as v; print('torch', v('torch'), 'torchvision', v('torchvision'))"  # stack: the build

UNRECORDED=0  # a check whose verdict could not be written has no row: the table alone would pass without it
check() { $PY scripts/gpu_checklist.py "$@" --out "$OUT" || { UNRECORDED=1; echo "gpu_check.sh: not recorded: $*" >&2; }; }

make_data() {  # KIND FOLDER COUNT SIZE: once per machine, into a temporary folder first so a cut-off one is not reused
  [ -d "$D/$2" ] && return
  rm -rf "$D/$2.part" && $PY -m gputrain data make "$1" --out "$D/$2.part" --count "$3" --size "$4" >/dev/null \
    && mv "$D/$2.part" "$D/$2"
}

make_jpegs() {  # 10 classes of 500x375 JPEGs, as ImageNet's photos (scripts/imagenet_like.py)
  [ -d "$JPEGS" ] && return
  rm -rf "$D/jpegs.part" && D=$D/jpegs.part PER_CLASS=$PER_CLASS $PY scripts/imagenet_like.py \
    && mv "$D/jpegs.part" "$D/jpegs-$PER_CLASS"
}

over_budget() {  # NAME SETTING: true (and a "not started" row) once BUDGET_S seconds are spent
  [ "${BUDGET_S:-0}" -gt 0 ] && [ "$SECONDS" -ge "$BUDGET_S" ] || return 1
  check mark "$1" skipped --why "not started: the budget of BUDGET_S=$BUDGET_S s was spent" --setting "$2"
}

PRE=""  # "plan: " while the plan part runs: its rows, data and settings those of the recipes, named apart
recipe() {  # NAME SETTING OVERRIDES...: one recipe for $EPOCHS epochs as users run it, then its verdict
  local name=$1 setting=$2; shift 2
  local label=$PRE${LABEL:-$name}; local slug=${label//[ :]/_}  # LABEL: a second run of one recipe (another precision)
  over_budget "$label" "$setting" && return
  if [ -n "$PRE" ]; then plans "$name" "$label" "$slug" "$setting" "$@"; return; fi
  # shellcheck disable=SC2086  # GPU_ARGS is a list of overrides
  $PY -m gputrain train "$name" --accelerator "$ACC" --epochs "$EPOCHS" --out "$R/$slug" --overwrite \
    trainer.progress_bar=false data.num_workers="$WORKERS" "$@" $GPU_ARGS 2>&1 | tee "$OUT/logs/$slug.log"
  check recipe "$label" "$R/$slug" --exit-code "${PIPESTATUS[0]}" --log "$OUT/logs/$slug.log" --setting "$setting"
}

plans() {  # NAME LABEL SLUG SETTING OVERRIDES...: the recipe's plans for one device, each trained a few steps with
  local name=$1 label=$2 slug=$3 setting=$4; shift 4  # its own predictions, set against what the run measures
  mkdir -p "$R/$slug"
  # shellcheck disable=SC2086
  $PY -m gputrain plan "$name" --accelerator "$ACC" --devices 1 --json "$R/$slug/plan.json" "$@" $GPU_ARGS 2>&1 \
    | tee "$OUT/logs/$slug.log"
  local code=${PIPESTATUS[0]} one values words trained=0
  if [ "$code" != 0 ]; then
    check mark "$label" fail --why "gputrain plan: exit $code: $(grep -i error "$OUT/logs/$slug.log" | tail -n 1)" \
      --setting "$setting"
    return
  fi
  while IFS=$'\t' read -r one values; do
    read -ra words <<< "$values"  # word by word, no globbing: parallel.split_points=[layer3]
    trained=$((trained + 1))
    over_budget "$label $one" "$setting" && continue
    # shellcheck disable=SC2086
    $PY -m gputrain train "$name" --accelerator "$ACC" --epochs 1 --out "$R/${slug}_$one" --overwrite \
      trainer.progress_bar=false data.num_workers="$WORKERS" "$@" $GPU_ARGS "${words[@]}" trainer.measure_memory=true \
      trainer.max_steps_per_epoch="${PLAN_STEPS:-22}" trainer.eval_every_n_epochs=2 trainer.enable_checkpointing=false \
      < /dev/null 2>&1 | tee "$OUT/logs/${slug}_$one.log"
    check plan "$label $one" "$R/${slug}_$one" --exit-code "${PIPESTATUS[0]}" --log "$OUT/logs/${slug}_$one.log" \
      --setting "$setting; $values" --plan-json "$R/$slug/plan.json"
  done < <($PY scripts/gpu_checklist.py plans "$R/$slug/plan.json")
  [ "$trained" -gt 0 ] || check mark "$label" fail --why "gputrain plan found no plan for one device that fits" \
    --setting "$setting"
}

run_recipe() {  # the data and settings of each built-in recipe
  if over_budget "$PRE$1" ""; then  # before its data is made, which takes time too
    [ "$1" != ade20k-deeplabv3plus ] || over_budget "${PRE}ade20k-deeplabv3plus 16-mixed" ""
    return
  fi
  case $1 in
    autoencoder)
      make_data imagefolder "frames-${FRAMES_COUNT:=2000}" "$FRAMES_COUNT" 80
      recipe autoencoder "$FRAMES_COUNT frames of 80x80" --data-root "$D/frames-$FRAMES_COUNT" ;;
    cifar10-resnet18)
      make_data cifar10 "cifar10-${CIFAR_COUNT:=12000}" "$CIFAR_COUNT" 32
      recipe cifar10-resnet18 "$CIFAR_COUNT CIFAR-10-format images of 32x32" --data-root "$D/cifar10-$CIFAR_COUNT" ;;
    cifar10-resnet18-recipe)  # the same data: TrivialAugmentWide, CutMix, label smoothing, EMA
      make_data cifar10 "cifar10-${CIFAR_COUNT:=12000}" "$CIFAR_COUNT" 32
      recipe cifar10-resnet18-recipe "$CIFAR_COUNT CIFAR-10-format images of 32x32" --data-root "$D/cifar10-$CIFAR_COUNT" ;;
    imagenet-resnet50-v2)  # torchvision's v2 recipe on the JPEGs, split 8:2; its crops (176, 232 -> 224) at 224
      make_jpegs
      local crops=""
      [ "$RESNET_SIZE" = 224 ] || crops="data.train_crop_size=$RESNET_SIZE data.val_resize_size=$RESNET_SIZE data.val_crop_size=$RESNET_SIZE"
      # shellcheck disable=SC2086
      recipe imagenet-resnet50-v2 "$((PER_CLASS * 10)) JPEGs of 500x375, the recipe's crops" --data-root "$JPEGS" \
        "data.val_root=''" data.val_fraction=0.2 scheduler.warmup_steps=10 $crops ;;
    imagefolder-resnet50)
      make_jpegs
      recipe imagefolder-resnet50 "$((PER_CLASS * 10)) JPEGs of 500x375, crops of $RESNET_SIZE" --data-root "$JPEGS" \
        data.image_size="$RESNET_SIZE" ;;
    ade20k-deeplabv3plus)  # the recipe's mixed (bf16 where the GPU has it), then 16-mixed: every step logged
      make_data ade20k "ade20k-${ADE_SIZE:=512}-${ADE_COUNT:=640}" "$ADE_COUNT" "$ADE_SIZE"
      local ade="$ADE_COUNT images of ${ADE_SIZE}x$ADE_SIZE, crops of $ADE_SIZE, 8 classes"
      recipe ade20k-deeplabv3plus "$ade" --data-root "$D/ade20k-$ADE_SIZE-$ADE_COUNT" data.image_size="$ADE_SIZE" \
        data.num_classes=8 trainer.log_every_n_steps=1
      if [ "$ACC" != cuda ]; then  # float16 autocast has no fast CPU kernels (docs/precision.md): nothing to learn
        check mark "${PRE}ade20k-deeplabv3plus 16-mixed" skipped --why "no GPU (float16 is 20-35x slower on a CPU)" \
          --setting "$ade"
      else
        LABEL="ade20k-deeplabv3plus 16-mixed" recipe ade20k-deeplabv3plus "$ade" --data-root \
          "$D/ade20k-$ADE_SIZE-$ADE_COUNT" data.image_size="$ADE_SIZE" data.num_classes=8 \
          trainer.log_every_n_steps=1 trainer.precision=16-mixed
      fi ;;
    coco-maskrcnn)
      make_data coco "coco-${COCO_SIZE:=640}-${COCO_COUNT:=400}" "$COCO_COUNT" "$COCO_SIZE"
      recipe coco-maskrcnn "$COCO_COUNT images of ${COCO_SIZE}x$COCO_SIZE resized to shorter side ${COCO_MIN:=800}" \
        --data-root "$D/coco-$COCO_SIZE-$COCO_COUNT" model.kwargs.min_size="$COCO_MIN" model.kwargs.max_size="${COCO_MAX:-1333}" ;;
    resnet50-model-parallel)  # both stages on cuda:0 where there is one GPU
      make_data classfolder "classes-${MP_SIZE:=64}-${MP_COUNT:=1000}" "$MP_COUNT" "$MP_SIZE"
      recipe resnet50-model-parallel "$MP_COUNT images of ${MP_SIZE}x$MP_SIZE" --data-root "$D/classes-$MP_SIZE-$MP_COUNT" \
        data.image_size="$MP_SIZE" ;;
    *)  # a new recipe must not pass unseen
      check mark "$PRE$1" fail --why "the checklist has no data or settings for this recipe: add them to scripts/gpu_check.sh" ;;
  esac
}

images() {  # ResNet-50 images/s, real JPEGs and synthetic, decoding in the workers, then on the GPU
  over_budget "ResNet-50 images/s, JPEGs decoded in the workers" "" \
    && over_budget "ResNet-50 images/s, JPEGs decoded on the GPU" "" && return
  make_jpegs
  for dod in false true; do
    local name="ResNet-50 images/s, JPEGs decoded in the workers"
    [ $dod = false ] || name="ResNet-50 images/s, JPEGs decoded on the GPU"
    over_budget "$name" "$((PER_CLASS * 10)) JPEGs of 500x375, crops of $RESNET_SIZE" && continue
    if [ $dod = true ] && [ "$ACC" != cuda ]; then  # on a CPU the same decoder runs, later: nothing to measure
      check mark "$name" skipped --why "no GPU (nvJPEG decoding needs CUDA)" --setting data.decode_on_device=true
      continue
    fi
    # shellcheck disable=SC2086
    $PY -m gputrain bench throughput imagefolder-resnet50 --accelerator "$ACC" --epochs "$EPOCHS" --data-root "$JPEGS" \
      --out "$R/images_decode_on_device_$dod" --overwrite trainer.batch_size="${BATCH:-256}" data.image_size="$RESNET_SIZE" \
      data.num_workers="$WORKERS" data.decode_on_device=$dod $GPU_ARGS 2>&1 | tee "$OUT/logs/images_$dod.log"
    check images "$name" "$R/images_decode_on_device_$dod" --exit-code "${PIPESTATUS[0]}" \
      --log "$OUT/logs/images_$dod.log" --setting "$((PER_CLASS * 10)) JPEGs of 500x375, crops of $RESNET_SIZE"
  done
}

stack() {  # what the machine has, and whether TorchCodec decodes a JPEG there (the data sets need it)
  over_budget "stack" "" && return
  $PY - "$ACC" > "$OUT/logs/stack.log" 2>&1 <<'PY'
import sys

import torch, torchcodec, torchvision
from torchcodec.decoders import decode_jpeg
from torchcodec.encoders import JpegEncoder

print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, torchcodec {torchcodec.__version__}, "
      f"python {sys.version.split()[0]}" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
image = torch.zeros(3, 64, 48, dtype=torch.uint8)
image[0] = 200
data = JpegEncoder(image).to_tensor(quality=95)
cpu = decode_jpeg(data)
assert cpu.shape == (3, 64, 48), cpu.shape
if sys.argv[1] == "cuda":
    gpu = decode_jpeg(data, device="cuda").cpu()
    print(f"JPEG decoded on the CPU and the GPU: largest difference {(gpu.int() - cpu.int()).abs().max().item()}")
else:
    print("JPEG decoded on the CPU")
PY
  local code=$?
  cat "$OUT/logs/stack.log"
  if [ $code = 0 ]; then
    check mark "stack" pass --why "$(paste -sd ';' "$OUT/logs/stack.log")"
  else
    check mark "stack" fail --why "$(grep -v '^ ' "$OUT/logs/stack.log" | tail -n 1)" --setting "$(head -n 1 "$OUT/logs/stack.log")"
  fi
}

cuda_tests() {
  over_budget "CUDA tests" "pytest -m cuda tests" && return
  if [ "$ACC" != cuda ]; then
    check mark "CUDA tests" skipped --why "no GPU (GPU_ACC=$ACC)" --setting "pytest -m cuda tests"
    return
  fi
  rm -f "$OUT/cuda_tests.xml"
  $PY -m pytest -q -m cuda -p no:cacheprovider --junitxml="$OUT/cuda_tests.xml" tests 2>&1 | tee "$OUT/logs/cuda_tests.log"
  check tests "$OUT/cuda_tests.xml" --exit-code "${PIPESTATUS[0]}" --log "$OUT/logs/cuda_tests.log"
}

for part in $PARTS; do
  case $part in
    stack) stack ;;
    tests) cuda_tests ;;
    recipes) for name in $RECIPES; do run_recipe "$name"; done ;;
    plan) PRE="plan: "; for name in $RECIPES; do run_recipe "$name"; done; PRE="" ;;
    plan:*) PRE="plan: "; run_recipe "${part#plan:}"; PRE="" ;;
    images) images ;;
    fast)  # issue 16's figures: ResNet-50 at 224 with each speed option, synthetic data
      make_jpegs
      $PY benchmarks/fast_path.py imagefolder-resnet50 --data-root "$JPEGS" --epochs 3 --reps "${REPS:-1}" ${EACH:-} \
        trainer.batch_size="${BATCH:-256}" data.image_size="$RESNET_SIZE" data.num_workers=auto \
        --json "$OUT/fast_path_resnet50.json" ;;
    bench)  # trainer overhead on one GPU; the autoencoder's images/s at two batch sizes
      $PY benchmarks/overhead.py --accelerator cuda --pairs 5 --json "$OUT/overhead_cuda.json"
      make_data imagefolder frames-12944 12944 80
      $PY -m gputrain bench scale autoencoder --devices 1 --batch-size 64,128 --epochs 4 --accelerator cuda \
        --out "$OUT/scale" data.root="$D/frames-12944" data.num_workers=6 ;;
    *) run_recipe "$part" ;;
  esac
done
[ -d "$OUT/checks" ] || exit 0  # only fast or bench: they printed their own figures
$PY scripts/gpu_checklist.py table "$OUT" | tee "$OUT/checklist.md"
verdict=${PIPESTATUS[0]}
exit $((verdict || UNRECORDED))
