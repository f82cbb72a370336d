#!/usr/bin/env bash
# The single-GPU targets of bench/perf_goals.py in one device call (~6 minutes on an H100): the attention kernel
# benchmark (DCA vs cuDNN causal at 8K/32K/128K, MHA and GQA; 8K again with 20 calls queued back
# to back, as inside a model, where host time hides behind the kernels; C = 2048 also replayed as
# CUDA graphs, 8K and 32K, speed only: the graphs' pools are not in its peak), where the peak memory
# goes at 32K and 128K (bench/attention_memory.py), gpt_1p3b standard and DCA at 32K and 128K
# with the fused norm and fused RoPE, then bench/perf_goals.py's goal table.
#
#   OUT=out PYTHON=python3 bash bench/perf_goals.sh
set -euo pipefail
OUT=${OUT:?set OUT to the output directory}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
# One log for every step (the device returns a limited number of files per run).
log="$OUT/run.log"
: > "$log"
step() { echo "== $*" >> "$log"; "$@" >> "$log" 2>&1; }
step "$PYTHON" -m bench.attention --seqs 8192,32768,131072 --repeats 10 --warmup 3 \
  --out "$OUT/attention.json"
step "$PYTHON" -m bench.attention --seqs 8192 --variants sdpa_cudnn,dca,dca_small,dca_small_graphs \
  --back-to-back 20 --repeats 10 --warmup 3 --out "$OUT/attention_b2b.json"
step "$PYTHON" -m bench.attention --seqs 8192,32768 --variants sdpa_cudnn,dca_small_graphs \
  --repeats 10 --warmup 3 --out "$OUT/attention_graphs.json"
step "$PYTHON" -m bench.attention_memory --seq 32768 131072 --out "$OUT/memory.json"
step "$PYTHON" bench/train.py --models gpt_1p3b --attention standard dca --seqs 32768 131072 \
  --steps 8 --warmup 3 --steps-for 131072:5:2 \
  --set trainer.fused_norm=true trainer.fused_rope=true \
  --set-for 131072 trainer.recompute=full --out "$OUT/train.json"
"$PYTHON" bench/perf_goals.py --attention "$OUT/attention.json" "$OUT/attention_b2b.json" \
  "$OUT/attention_graphs.json" \
  --train "$OUT/train.json" --out "$OUT/goals.json" | tee "$OUT/goals.md"
