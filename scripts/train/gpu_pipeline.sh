#!/usr/bin/env bash
# The shipped model's training on one GPU, in stages that each fit one call of limited time
# (state under runs/, kept between calls on the same machine; figures and small files -> $OUT):
#   bash scripts/train/gpu_pipeline.sh backbone SECONDS   # corpus (once), then backbone training
#                                                         # for at most SECONDS of this call
#   bash scripts/train/gpu_pipeline.sh export             # bf16 + fp8 exports, held-out bits/byte
#   bash scripts/train/gpu_pipeline.sh dspark SECONDS     # DSpark stages on the frozen backbone
# Settings (env): TRAIN_SECONDS (stepping time of the whole backbone run, default 700), BATCH
# (16), SEQ (1024), LR (2e-3).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/runs/out}"
mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
CORPUS=runs/corpus RUN=runs/small
BATCH="${BATCH:-16}" SEQ="${SEQ:-1024}" LR="${LR:-2e-3}" TRAIN_SECONDS="${TRAIN_SECONDS:-700}"
stage=${1:?stage: backbone | export | dspark}

corpus() {
  if [ ! -f "$CORPUS/corpus_stats.json" ]; then
    "$PY" scripts/train/prepare_corpus.py --out "$CORPUS" --no-progress >"$OUT/corpus.log" 2>&1 || { tail -20 "$OUT/corpus.log"; exit 1; }
  fi
  tail -2 "$OUT/corpus.log" 2>/dev/null
  cp "$CORPUS"/corpus_stats.json "$CORPUS"/tokenizer.json "$CORPUS"/tokenizer_config.json "$CORPUS"/tokenizer_ids.json "$OUT/"
}

train_args=(--config v41-small --tokenizer "$CORPUS" --data "$CORPUS/train.npy" --steps auto
            --train-seconds "$TRAIN_SECONDS" --batch "$BATCH" --seq-len "$SEQ" --lr "$LR" --out "$RUN"
            --save-every 500 --resume)

case $stage in
  backbone)
    t0=$(date +%s)
    corpus
    left=$(( ${2:?seconds} - ($(date +%s) - t0) ))
    "$PY" scripts/train/train.py "${train_args[@]}" --time-budget "$left" 2>"$OUT/train_stderr.log" | tee -a "$OUT/train.log"
    cp "$RUN/metrics.jsonl" "$RUN/meta.json" "$OUT/"
    ;;
  export)
    for dt in bf16 fp8; do
      "$PY" scripts/train/train.py "${train_args[@]}" --time-budget 1 --export "runs/export_$dt" --export-dtype "$dt" \
        --export-shard-mb 15 2>>"$OUT/export_stderr.log" | tail -1
      cp "$CORPUS"/tokenizer*.json "runs/export_$dt/"
    done
    "$PY" scripts/train/evaluate_model.py --corpus "$CORPUS" --model runs/export_bf16 --model runs/export_fp8 \
      --random-init --out "$OUT/heldout_bpb.json" 2>"$OUT/eval_stderr.log"
    cp runs/export_fp8/* "$OUT/" 2>/dev/null; ls -la "$OUT"
    ;;
  *) echo "unknown stage $stage"; exit 2;;
esac
