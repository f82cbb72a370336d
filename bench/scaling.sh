#!/usr/bin/env bash
# The two-GPU scaling table in one call (bench/scaling.py): every layout two GPUs allow (DP=2,
# TP=2 + SP, CP=2, CP=2 with the exchange not overlapped, PP=2) against one GPU, by length,
# written to $OUT/scaling.json, scaling.md and scaling.png. The plan and each case's estimated
# time are printed first; cases past the budget are skipped and listed (default: gpt_1p3b DCA at
# 16K and 32K, ~7.5 minutes on two H200s).
#
#   OUT=out bash bench/scaling.sh                         # the default table
#   OUT=out ATTENTION=standard bash bench/scaling.sh      # standard attention's CP rows
#   OUT=out SEQS=131072 bash bench/scaling.sh             # 128K, full recompute
#   OUT=out PROFILE=1 bash bench/scaling.sh               # one CP=2 DCA step at 16K, profiled
#   OUT=out MODEL=tiny SEQS=128 BUDGET=0 DEADLINE=0 EXTRA=trainer.device=cpu \
#     bash bench/scaling.sh                               # the CPU check (gloo)
#
# Arguments go on to bench/scaling.py (--layouts, --set-for, --dry-run: see its --help).
set -euo pipefail
OUT=${OUT:?set OUT to the output directory}
MODEL=${MODEL:-gpt_1p3b}
SEQS=${SEQS:-16384 32768}
ATTENTION=${ATTENTION:-dca standard}
EXTRA=${EXTRA-trainer.fused_norm=true}
BUDGET=${BUDGET:-450}
DEADLINE=${DEADLINE:-540}
PYTHON=${PYTHON:-python3}
args=(--out "$OUT" --model "$MODEL" --budget "$BUDGET" --deadline "$DEADLINE")
# shellcheck disable=SC2086  # the lists split into words
args+=(--seqs $SEQS --attention $ATTENTION --set $EXTRA)
if [ -n "${PROFILE:-}" ]; then
  args+=(--profile)
fi
exec "$PYTHON" "$(dirname "$0")/scaling.py" "${args[@]}" "$@"
