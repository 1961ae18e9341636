#!/usr/bin/env bash
# GPU check of `outlierscope train --device cuda` (bf16 autocast, same data order as the CPU).
#
# For a machine with a CUDA GPU whose own python3 holds torch with CUDA and transformers >= 5.17
# (nothing is installed; the repository is used in place through PYTHONPATH). It runs
#   1. the tests marked `cuda` (tests/train/test_train.py: a pair-test run on the GPU tracks the
#      CPU fp32 run step by step, is interrupted and resumed, and its checkpoint loads on the CPU);
#   2. a timed slice of a real run of PRESET on a carried corpus shard, as a measurement of
#      tokens/s and of the loss curve (stopped by --time-limit; it can be continued with --resume).
# and copies the small results (logs, run.json, model cards, pytest output) to OUTDIR.
#
# Prepare here (.corpus/ is git-ignored: the corpus never enters the repository):
#   mkdir -p .corpus && cp ../shared/corpus/wiki-train-00.jsonl.xz ../shared/corpus/wiki-val.jsonl.xz .corpus/
# then run it there with `.corpus` carried:  bash bench/cuda_check.sh "$OUT"
#
# Settings (environment): PRESET (pair-small), TOKENS per model (20000000), MINUTES of training (5),
# TOKENIZER_CHARS (20000000), CORPUS_DIR (.corpus), DEVICE (cuda), PYTHON (python3).
set -euo pipefail

outdir=${1:-runs/cuda_check}
preset=${PRESET:-pair-small}
tokens=${TOKENS:-20000000}
minutes=${MINUTES:-5}
tokenizer_chars=${TOKENIZER_CHARS:-20000000}
corpus_dir=${CORPUS_DIR:-.corpus}
device=${DEVICE:-cuda}  # DEVICE=cpu PRESET=pair-test: a dry run of this script without a GPU

mkdir -p "$outdir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}

"$py" - <<'EOF' | tee "$outdir/env.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__)
print("cuda available:", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

set +e
"$py" -m pytest -q -p no:cacheprovider -o addopts= -m cuda -rs tests/train/test_train.py 2>&1 | tee "$outdir/pytest.txt"
tests_rc=${PIPESTATUS[0]}
set -e

shopt -s nullglob
train_files=("$corpus_dir"/wiki-train-*.jsonl.xz)
if [ ${#train_files[@]} -eq 0 ]; then
    echo "no training shard in $corpus_dir (see the header of this script); skipping the timed run" | tee "$outdir/train.txt"
    exit "$tests_rc"
fi
val_args=()
[ -f "$corpus_dir/wiki-val.jsonl.xz" ] && val_args=(--val-corpus "$corpus_dir/wiki-val.jsonl.xz")

run="runs/cuda_check_$preset"
rm -rf "$run"
"$py" -m outlierscope train --preset "$preset" --corpus "${train_files[@]}" "${val_args[@]}" \
    --tokens "$tokens" --out "$run" --device "$device" --time-limit "$minutes" --eval-every 100 \
    --tokenizer-chars "$tokenizer_chars" --ckpt-minutes 1000 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -n 40 | tee "$outdir/train.txt"
cp "$run/run.json" "$run/train_log.csv" "$outdir/"
cp "$run/diff/README.md" "$outdir/model_card_diff.md"
cp "$run/transformer/README.md" "$outdir/model_card_transformer.md"
exit "$tests_rc"
