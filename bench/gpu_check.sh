#!/usr/bin/env bash
# GPU check of issue 14 (devices, bf16, device maps, blocked attention): one prepared script, < 5 min on one H200.
#
# For a CUDA machine whose python3 holds torch with CUDA, transformers >= 5.17, accelerate, pandas, tqdm and
# seaborn (nothing is installed; the repository is used in place through PYTHONPATH). From the repository root:
#
#   bash bench/gpu_check.sh "$OUT"
#
# It runs, writing at most 8 small files into OUTDIR:
#   1. env.txt: torch, transformers, the GPU;
#   2. pytest.txt: the tests marked `cuda` (tests/test_cuda.py: our attention vs sdpa/eager in fp32 and bf16,
#      quantized logits vs the CPU, blocked vs unblocked, reducers fed CUDA tensors, the bitsandbytes float16
#      path, a device map split between cuda:0 and the CPU; tests/train: bf16 training on the GPU);
#   3. attention_memory.txt and attention_memory_cuda.json: bench/attention_memory.py on the GPU (peak memory
#      and time of one 2,048-token forward, unblocked vs blocked, SmolLM2-135M and Llama-3-8B layer shapes);
#   4. sweep.txt + sweep.json: a timed `sweep` (16 and 4 bits, per_tensor, LIMIT items, bf16) and
#      profile.txt + profile.json: a timed `profile` (TOKENS tokens, sequence length 512), on SmolLM2-135M when
#      it is in $OUTLIERSCOPE_CACHE/models (it is 517 MB: too large to carry, so usually not), else on a random
#      model of its shape (seeded; accuracy then means nothing, the timing does);
#   5. fused.txt: the same sweep with --fused (the quantizers compiled by torch.compile, #64): its wall time, each
#      cell's seconds beside step 4's, and whether every csv (sweep tables, per-item cells) is byte-identical.
#
# Prepare here (.gpu_cache/ is git-ignored): mkdir -p .gpu_cache && cp ~/.cache/outlierscope/hellaswag-validation.arrow .gpu_cache/
# then run it there with `.gpu_cache` carried. DRY_RUN=1 runs every step on the CPU with tiny sizes (the tests do).
# Settings (environment): LIMIT (2000), TOKENS (400000), PYTHON (python3), OUTLIERSCOPE_CACHE (.gpu_cache).
set -uo pipefail

outdir=${1:-runs/gpu_check}
py=${PYTHON:-python3}
dry=${DRY_RUN:-0}
limit=${LIMIT:-2000}
tokens=${TOKENS:-400000}
device=cuda
seq=512
if [ "$dry" = 1 ]; then device=cpu; limit=6; tokens=2048; seq=64; fi
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg OUTLIERSCOPE_CACHE=${OUTLIERSCOPE_CACHE:-$PWD/.gpu_cache}
rc=0
step() { echo "== $*" >&2; }

step "1/5 environment"
"$py" - <<'PY' > "$outdir/env.txt" 2>&1 || rc=1
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda)
print("cuda available:", torch.cuda.is_available(), *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
print("tf32 matmul allowed:", torch.backends.cuda.matmul.allow_tf32, "(outlierscope leaves it off: float32 logits are full float32)")
PY
cat "$outdir/env.txt"

step "2/5 tests marked cuda"
"$py" -m pytest -q -p no:cacheprovider -o addopts= -m cuda -rs tests/test_cuda.py tests/train/test_train.py \
    > "$outdir/pytest.txt" 2>&1
t=$?; [ $t -ne 0 ] && [ $t -ne 5 ] && rc=1  # 5: nothing collected
tail -n 5 "$outdir/pytest.txt"

step "3/5 blocked attention memory"
mem_args=(--device "$device"); [ "$dry" = 1 ] && mem_args+=(--dry-run)
BENCH_RESULTS="$outdir" "$py" bench/attention_memory.py "${mem_args[@]}" > "$outdir/attention_memory.txt" 2>&1 || rc=1
tail -n 3 "$outdir/attention_memory.txt"

step "4/5 timed sweep and profile"
model="$OUTLIERSCOPE_CACHE/models/smollm2-135m"
if [ "$dry" = 1 ]; then
    model=pair-tiny:diff
elif [ ! -f "$model/config.json" ]; then
    model="$work/smollm2-shaped"
    "$py" - "$model" <<'PY' || rc=1
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from outlierscope.models.loading import load_model
tok = load_model("pair-tiny:diff", device="cpu").tokenizer  # any tokenizer: the weights are random
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, dtype="bfloat16")
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
print("random model of SmolLM2-135M's shape (seeded) at", sys.argv[1])
PY
fi
dt=auto; [ "$dry" = 1 ] && dt=float32
timed() { local t0=$EPOCHREALTIME; "$@"; local r=$?; awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN{printf "wall %.1f s\n", b - a}'; return $r; }
sweep_args=(--model "$model" --bits 16 4 --limit "$limit" --device "$device" --dtype "$dt" --batch-size 64)  # steps 4, 5
{ timed "$py" -m outlierscope sweep "${sweep_args[@]}" --out "$work/sweep" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -n 25; } \
    > "$outdir/sweep.txt" 2>&1 || rc=1
cp "$work/sweep/sweep.json" "$outdir/" 2>/dev/null || rc=1
{ timed "$py" -m outlierscope profile --model "$model" --tokens "$tokens" \
    --seq-len "$seq" --device "$device" --dtype "$dt" --batch-size 16 --out "$work/profile" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -n 25; } \
    > "$outdir/profile.txt" 2>&1 || rc=1
cp "$work/profile/profile.json" "$outdir/" 2>/dev/null || rc=1
tail -n 3 "$outdir/sweep.txt" "$outdir/profile.txt"

step "5/5 the same sweep with the quantizers compiled (--fused): its time and its bytes against step 4's"
{ timed "$py" -m outlierscope sweep "${sweep_args[@]}" --fused --out "$work/sweep-fused" 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tail -n 8
  "$py" - "$work/sweep" "$work/sweep-fused" <<'PY'
import json, sys
from pathlib import Path
eager, fused = (Path(d) for d in sys.argv[1:])
names = sorted(p.relative_to(eager).as_posix() for p in eager.rglob("*.csv"))
differ = [n for n in names if not (fused / n).exists() or (fused / n).read_bytes() != (eager / n).read_bytes()]
cells = {d.name: {c["label"]: c["seconds"] for c in json.loads((d / "sweep.json").read_text())["cells"]}
         for d in (eager, fused)}
print(json.dumps({"csv_files": len(names), "byte_identical": len(names) - len(differ), "differ": differ,
                  "cell_seconds": cells}))
PY
} > "$outdir/fused.txt" 2>&1 || rc=1
tail -n 2 "$outdir/fused.txt"
echo "gpu_check exit $rc; files in $outdir" >&2
exit $rc
