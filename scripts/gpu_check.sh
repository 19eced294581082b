#!/usr/bin/env bash
# The GPU checks in one command, on one CUDA GPU (what docs/scaling.md's "Measured on one H100" ran):
#   1. DeepSpeed ZeRO-2 and ZeRO-3 end to end on the tiny model (tests/test_deepspeed.py -k fit_on_gpu)
#   2. the Llama-3-8B-shaped phases and speed (scripts/gpu_phases.py)
#   3. with a shared folder: SmolLM2-135M cut by a saved plan, KD_STEPS distillation steps, then perplexity
#
#   bash scripts/gpu_check.sh OUT_DIR [SHARED_DIR [PLAN_JSON]]
#
# SHARED_DIR has ../shared's layout (models/smollm2-135m-instruct-gguf/*.gguf, data/wikitext2, data/ptb,
# data/corpus/brown.txt). PLAN_JSON: a plan.json of the default cut (else the run cuts with configs/smollm2.yaml's
# defaults: the search, minutes more). Time bounds, from the environment: DS_SECONDS (150), PHASES_DEADLINE
# (seconds after which gpu_phases skips what is left, 240), KD_STEPS (1000; about 0.32 s each on an H100),
# KD_MAX_TIME (Lightning's max_time, 00:00:06:00); CHECKS, the checks to run (default "deepspeed phases kd", the
# three above). Run from the repository root; prunelight need not be installed.
set -o pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [SHARED_DIR [PLAN_JSON]]}
shared=${2:-}
plan=${3:-}
checks=" ${CHECKS:-deepspeed phases kd} "
for c in $checks; do
  case " deepspeed phases kd " in *" $c "*) ;; *) echo "CHECKS: '$c' is not a check (deepspeed, phases, kd)"; exit 2;; esac
done

mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$py -m pip show torch transformers peft lightning deepspeed 2>/dev/null | grep -E "^(Name|Version)" | paste - - \
  | tee "$out/versions.txt"

if [[ $checks == *" deepspeed "* ]]; then
t0=$(date +%s)
timeout "${DS_SECONDS:-150}" $py -m pytest -q -p no:cacheprovider tests/test_deepspeed.py -k fit_on_gpu \
  > "$out/deepspeed.log" 2>&1
echo "deepspeed: rc $? in $(( $(date +%s) - t0 )) s: $(tail -1 "$out/deepspeed.log")"
fi

if [[ $checks == *" phases "* ]]; then
t0=$(date +%s)
$py scripts/gpu_phases.py --out "$out/gpu_phases_8b" --deadline "${PHASES_DEADLINE:-240}" > "$out/phases.log" 2>&1
echo "phases: rc $? in $(( $(date +%s) - t0 )) s"
cat "$out/gpu_phases_8b.md" 2>/dev/null
fi

[[ -n $shared && $checks == *" kd "* ]] || exit 0
gguf=$(ls "$shared"/models/smollm2-135m-instruct-gguf/*.gguf | head -1)
t0=$(date +%s)
$py -m prunelight fit --config configs/smollm2.yaml --data.seq_len=256 --model.pretrained="$(dirname "$gguf")" \
  --model.gguf_file="$(basename "$gguf")" --data.calibration.path="$shared/data/wikitext2/valid.txt" \
  --data.eval.path="$shared/data/wikitext2/test.txt" --data.train.path="$shared/data/corpus/brown.txt" \
  --data.train.max_tokens=1100000 ${plan:+--prune.plan="$plan"} --model.distillation.alpha=1.0 \
  --model.distillation.temperature=1.0 --trainer.accelerator=gpu --trainer.devices=1 \
  --trainer.precision=bf16-mixed --trainer.max_steps="${KD_STEPS:-1000}" --trainer.max_time="${KD_MAX_TIME:-00:00:06:00}" \
  --trainer.limit_val_batches=0 --evaluation.data_eval=false --export.out_dir="$out/kd" \
  --trainer.enable_progress_bar=false > "$out/kd.log" 2>&1
echo "distillation: rc $? in $(( $(date +%s) - t0 )) s; steps $($py -c "import json,sys; print(json.load(open(sys.argv[1]))['recovery']['steps'])" "$out/kd/report.json" 2>/dev/null)"
cat > "$out/suite.yaml" <<EOF
evaluation:
  ppl_datasets:
    wikitext2: {path: $shared/data/wikitext2/test.txt}
    ptb: {path: $shared/data/ptb/test.txt}
  seq_lens: [512]
  ppl_batch_size: 4
  max_windows: 32
  zeroshot: false
  efficiency: false
EOF
$py -m prunelight evaluate --config "$out/suite.yaml" --models="{\"kd\": \"$out/kd/model\"}" --dense=false \
  --device=cuda --out_dir="$out/eval_kd" > "$out/eval.log" 2>&1
echo "evaluate: rc $?"; grep "ppl" "$out/eval.log"
