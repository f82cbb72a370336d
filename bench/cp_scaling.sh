#!/bin/bash
# Context-parallel scaling: gpt_1p3b with DCA, CP=2 over two GPUs against CP=1 on one,
# bf16, full recompute keeping attention outputs. One torchrun per case (a process group per
# run); every case writes OUT/cp<N>_<seq>.json and its log to OUT/cp<N>_<seq>.log.
#   OUT=results bash bench/cp_scaling.sh "2 1" 131072 262144
# First argument: the CP sizes to run, in order; then the sequence lengths (default 131072).
# Steps: 4 with 2 of warm-up (medians of the last 2); 3 with 1 at 262144, whose steps are ~45 s.
set -uo pipefail
out=${OUT:-.}
cps=${1:-"2 1"}
shift || true
seqs=${*:-131072}
mkdir -p "$out"
for seq in $seqs; do
  for cp in $cps; do
    args=(bench/train.py --models gpt_1p3b --attention dca --seqs "$seq"
          --steps 4 --warmup 2 --steps-for 262144:3:1
          --set trainer.fused_norm=true trainer.recompute=full "parallel.cp=$cp"
          --out "$out/cp${cp}_${seq}.json")
    if [ "$cp" -gt 1 ]; then
      launch=(python3 -m torch.distributed.run --standalone --nproc-per-node "$cp")
    else
      launch=(env CUDA_VISIBLE_DEVICES=0 python3)
    fi
    echo "== cp=$cp seq=$seq: ${launch[*]} ${args[*]}"
    "${launch[@]}" "${args[@]}" > "$out/cp${cp}_${seq}.log" 2>&1
    echo "exit $?"
    grep -E '^\| gpt_1p3b|Error|error' "$out/cp${cp}_${seq}.log" | tail -3
  done
done
