#!/usr/bin/env bash
# The shipped model's training on one GPU, in stages that each fit one call of limited time
# (state under runs/, kept between calls on the same machine; figures and small files -> $OUT):
#   bash scripts/train/gpu_pipeline.sh backbone SECONDS   # corpus (once), then backbone training
#                                                         # for at most SECONDS of this call
#   bash scripts/train/gpu_pipeline.sh finish B D [CALL]  # backbone for at most B more seconds (it
#        stops at its total), DSpark stages for D seconds of stepping on the frozen backbone, bf16
#        + fp8 exports with the stages (the fp8 export -> $OUT at once), then DSpark acceptance
#        (greedy and temperature 1) and held-out bits/byte (bf16, fp8, random init); with CALL (the
#        call's time limit in seconds) the two measurements are cut short so that the archives
#        are written before the limit
# The DSpark stages of the shipped model, retrained on its own continuations (scripts/train/
# regenerate_data.py; runs/regen travels between calls with the device tool's carry):
#   bash scripts/train/gpu_pipeline.sh regen SECONDS      # prompts from the training split, continued by
#        the shipped model for at most SECONDS (regen.npy, heldout.npy, regen_meta.json -> $OUT)
#   bash scripts/train/gpu_pipeline.sh stages D [CALL]    # the shipped model's stages trained on runs/regen
#        for D seconds of stepping (from the shipped stages), fp8 export -> $OUT, DSpark acceptance of the
#        new and the shipped stages on the same held-out prompts. DS_DATA=corpus: trained on the real
#        text of the training split instead (encoded with the shipped tokenizer into runs/regen/train.npy
#        first if it is not there, the held-out list checked), random windows of SEQ tokens
# Settings (env): TRAIN_SECONDS (stepping time of the whole backbone run, default 700), BATCH
# (16), SEQ (1024), LR (2e-3), ANCHORS (64), DS_LR (6e-4), NPROMPTS (32), MAXWIN (all windows),
# DS_DATA (regen | corpus, for `stages`), REPEAT_FRAC (`stages`: the fraction of windows ending in a
# repeated period, train_dspark.py --repeat-frac; default none).
# $OUT gets at most 8 files (what the lent GPU machine returns): figures.tgz (metrics, meta,
# logs, JSON figures), model_meta.tgz (config, index, tokenizer) and the fp8 export's shards
# (15 MB each).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/runs/out}"
mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
CORPUS=runs/corpus RUN=runs/small
BATCH="${BATCH:-16}" SEQ="${SEQ:-1024}" LR="${LR:-2e-3}" TRAIN_SECONDS="${TRAIN_SECONDS:-700}"
stage=${1:?stage: backbone | finish | regen | stages}
SHIPPED=deepinfer_jax/assets/v41-small-code REGEN=runs/regen PROMPT="${PROMPT:-256}" NEW="${NEW:-768}"

corpus() {
  if [ ! -f "$CORPUS/corpus_stats.json" ]; then
    "$PY" scripts/train/prepare_corpus.py --out "$CORPUS" --no-progress >"$OUT/corpus.log" 2>&1 || { tail -20 "$OUT/corpus.log"; exit 1; }
  fi
  tail -2 "$OUT/corpus.log" 2>/dev/null
}

left() {  # seconds until $1 seconds before the call's limit $call, counted from $t0 (at least 1)
  if [ -z "${call:-}" ]; then echo 100000; return; fi
  local s=$(( call - ($(date +%s) - t0) - $1 )); echo $(( s > 1 ? s : 1 ))
}

pack() {  # the small files as one archive (the machine returns at most 8 files)
  local t; t=$(mktemp -d)
  cp "$RUN"/*.jsonl "$RUN"/*meta.json "$t/" 2>/dev/null
  cp "$CORPUS"/corpus_stats.json "$CORPUS"/heldout_files.txt "$t/" 2>/dev/null
  mv "$OUT"/*.log "$OUT"/*.json "$t/" 2>/dev/null
  tar czf "$OUT/figures.tgz" -C "$t" .
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
    pack
    ;;
  finish)
    t0=$(date +%s)
    "$PY" scripts/train/train.py "${train_args[@]}" --time-budget "${2:?backbone seconds}" 2>"$OUT/train_stderr.log" | tee -a "$OUT/train.log"
    ds_args=(--model-run "$RUN" --tokenizer "$CORPUS" --data "$CORPUS/train.npy" --steps auto
             --train-seconds "${3:?dspark seconds}" --batch "$BATCH" --seq-len "$SEQ" --anchors "${ANCHORS:-64}"
             --lr "${DS_LR:-6e-4}" --out "$RUN" --save-every 500 --resume)
    "$PY" scripts/train/train_dspark.py "${ds_args[@]}" 2>"$OUT/dspark_stderr.log" | tee -a "$OUT/dspark.log"
    for dt in bf16 fp8; do
      "$PY" scripts/train/train_dspark.py "${ds_args[@]}" --export "runs/export_$dt" --export-dtype "$dt" \
        --export-shard-mb 15 2>>"$OUT/export_stderr.log" | tail -1
      cp "$CORPUS"/tokenizer*.json "runs/export_$dt/"
    done
    (cd runs/export_fp8 && tar czf "$OUT/model_meta.tgz" config.json model.safetensors.index.json tokenizer*.json \
      && cp model-*.safetensors "$OUT/")
    call=${4:-}
    timeout "$(left 20)" "$PY" scripts/eval/dspark_acceptance.py --model runs/export_fp8 --tokenizer runs/export_fp8 \
      --heldout "$CORPUS/heldout.npy" --n-prompts "${NPROMPTS:-32}" --prompt-len 256 --max-new-tokens 128 \
      --temperature 0 1 --trace --out "$OUT/dspark_acceptance.json" 2>"$OUT/accept_stderr.log" | tail -8
    timeout "$(left 12)" "$PY" scripts/train/evaluate_model.py --corpus "$CORPUS" --model runs/export_bf16 --model runs/export_fp8 \
      --random-init ${MAXWIN:+--max-windows $MAXWIN} --out "$OUT/heldout_bpb.json" 2>"$OUT/eval_stderr.log"
    pack
    ls -la "$OUT"
    ;;
  regen)
    "$PY" scripts/train/regenerate_data.py --out "$REGEN" --model "$SHIPPED" \
      --check-heldout benchmarks/results/v41_small_code_H200/heldout_files.txt --heldout --no-progress \
      --sequences "${REGEN_SEQS:-4096}" --prompt-len "$PROMPT" --new-tokens "$NEW" --batch-size "${REGEN_BATCH:-512}" \
      --temperature ${REGEN_TEMPS:-0 0 0 1} --time-budget "${2:?seconds}" >"$OUT/regen.log" 2>&1 || { tail -20 "$OUT/regen.log"; exit 1; }
    tail -3 "$OUT/regen.log"
    cp "$REGEN"/regen.npy "$REGEN"/heldout.npy "$REGEN"/regen_meta.json "$OUT/"
    ;;
  stages)
    t0=$(date +%s)
    RUN=runs/dspark_${DS_DATA:-regen}
    call=${3:-}
    if [ "${DS_DATA:-regen}" = corpus ]; then
      if [ ! -f "$REGEN/train.npy" ]; then
        "$PY" scripts/train/regenerate_data.py --out "$REGEN" --model "$SHIPPED" --sequences 0 --train-split --heldout \
          --check-heldout benchmarks/results/v41_small_code_H200/heldout_files.txt --no-progress >"$OUT/split.log" 2>&1 \
          || { tail -20 "$OUT/split.log"; exit 1; }
        tail -2 "$OUT/split.log"
      fi
      data=(--data "$REGEN/train.npy" --seq-len "$SEQ")
    else
      data=(--data "$REGEN/regen.npy" --sequences --anchor-low "$PROMPT" --seq-len $((PROMPT + NEW)))
    fi
    ds_args=(--model-run "$SHIPPED" --tokenizer "$SHIPPED" "${data[@]}"
             --steps auto --train-seconds "${2:?dspark seconds}" --batch "$BATCH"
             --anchors "${ANCHORS:-64}" --lr "${DS_LR:-6e-4}" --out "$RUN" --save-every 500 --resume)
    if [ -n "${REPEAT_FRAC:-}" ]; then ds_args+=(--repeat-frac "$REPEAT_FRAC"); fi
    "$PY" scripts/train/train_dspark.py "${ds_args[@]}" 2>"$OUT/dspark_stderr.log" | tee -a "$OUT/dspark.log"
    "$PY" scripts/train/train_dspark.py "${ds_args[@]}" --export runs/export_regen_fp8 --export-dtype fp8 \
      --export-shard-mb 15 2>>"$OUT/export_stderr.log" | tail -1
    cp "$SHIPPED"/tokenizer*.json runs/export_regen_fp8/
    (cd runs/export_regen_fp8 && tar czf "$OUT/model_meta.tgz" config.json model.safetensors.index.json tokenizer*.json \
      && cp model-*.safetensors "$OUT/")
    acc=(--tokenizer "$SHIPPED" --heldout "$REGEN/heldout.npy" --n-prompts "${NPROMPTS:-32}" --prompt-len "$PROMPT"
         --max-new-tokens 128)
    timeout "$(left 110)" "$PY" scripts/eval/dspark_acceptance.py --model runs/export_regen_fp8 "${acc[@]}" \
      --temperature 0 1 --trace --out "$OUT/dspark_acceptance.json" 2>"$OUT/accept_stderr.log" | tail -4
    timeout "$(left 10)" "$PY" scripts/eval/dspark_acceptance.py --model "$SHIPPED" "${acc[@]}" \
      --temperature 0 --out "$OUT/dspark_acceptance_shipped.json" 2>>"$OUT/accept_stderr.log" | tail -3
    cp "$REGEN"/regen_meta.json "$OUT/" 2>/dev/null
    pack
    ls -la "$OUT"
    ;;
  *) echo "unknown stage $stage"; exit 2;;
esac
