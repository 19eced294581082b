#!/usr/bin/env bash
# Exact resume on the reference job: an uninterrupted run, and the same run resumed with --ckpt_path from its
# step-20 checkpoint (as after `kill -9`), must end at the same recovered perplexity.
#   OMP_NUM_THREADS=1 bash scripts/resume_check.sh /tmp/resume-check [steps] [checkpoint every] [eval blocks]
set -euo pipefail
OUT=${1:?output folder}; STEPS=${2:-40}; EVERY=${3:-20}; BLOCKS=${4:-64}
ARGS=(fit --config configs/reference.yaml --trainer.max_steps="$STEPS" --trainer.limit_val_batches=0
      --data.max_eval_blocks="$BLOCKS" --trainer.enable_progress_bar=false
      --trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint --trainer.callbacks.every_n_train_steps="$EVERY"
      --trainer.callbacks.save_top_k=-1)
python -m prunelight "${ARGS[@]}" --trainer.callbacks.dirpath="$OUT/straight/ckpt" --export.out_dir="$OUT/straight" \
  > "$OUT/straight.log" 2>&1 &
CKPT="$OUT/straight/ckpt/epoch=0-step=$EVERY.ckpt"
until [ -f "$CKPT" ]; do sleep 2; done
python -m prunelight "${ARGS[@]}" --trainer.callbacks.dirpath="$OUT/resumed/ckpt" --export.out_dir="$OUT/resumed" \
  --ckpt_path="$CKPT" > "$OUT/resumed.log" 2>&1
wait
python - "$OUT" <<'PY'
import json, sys
for run in ("straight", "resumed"):
    r = json.load(open(f"{sys.argv[1]}/{run}/report.json"))
    print(run, "steps", r["recovery"]["steps"], "ppl", r["ppl"])
PY
