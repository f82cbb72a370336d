#!/usr/bin/env bash
# DCA on FlashAttention-4, measured on one H100 (FA4 installed; see README "Long sequences"),
# one process per table, logs and JSON under $OUT:
#   tests   the FA4 GPU tests (tests/gpu/test_fa4_gpu.py) and the cuDNN DCA test beside them
#   attn    bench.attention at 32K/128K (16/16, 16/4 heads): cuDNN causal, FA4 causal, DCA on
#           cuDNN and on FA4 parts, chunked on FA4; a profile of DCA on FA4 at 32K
#   small   bench.attention at 8K, DCA with C = 2048 (cuDNN, FA4), one call and 20 back to back
#   graphs  DCA's passes replayed as CUDA graphs on FA4 (host time per FA4 call hidden), 8K
#           C = 2048 and 32K C = 8192, one call per sample
#   inplace DCA's kernels as the default (trainer.dca_backward=auto: the backward kernel in
#           groups of heads or pieces of rows, dQ rotated back in one pass) against one_piece and
#           the part calls: 8K C = 2048 back to back; 32K and 128K with a profile of auto at
#           32K and every variant's ratio to FA4 causal in alternating pairs (--paired)
#   goals   gpt_1p3b standard and DCA (auto, one_piece) at 32K / 128K, then the targets
#           judged by bench/fa4_goals.py (goals.md) off that and `inplace`'s files (the two
#           stages take ~5 and ~7 minutes on the H100: one device call each)
#   train   gpt_1p3b standard / DCA, cuDNN and FA4 kernels, 32K (fused norm + RoPE) and 128K
#           (full recompute)
#   firstuse what a run pays for the JIT compiles: gpt_1p3b at 32K, one process per run, with
#           empty compile caches, then with the ones that run filled (bench/first_use.py)
#
#   OUT=out PYTHON=python3 bash bench/fa4_goals.sh tests attn small inplace goals train firstuse
set -uo pipefail
OUT=${OUT:?set OUT to the output directory}
PYTHON=${PYTHON:-python}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case $stage in
    tests) "$PYTHON" -m pytest -q -p no:cacheprovider -s tests/gpu/test_fa4_gpu.py \
             tests/models/test_kernel_choice.py \
             "tests/gpu/test_dca_gpu.py::test_bf16_fast_path_matches_float64_reference" \
             2>&1 | tee "$OUT/tests.log" | grep -E "relative errors|passed|failed|Error" ;;
    attn) "$PYTHON" -m bench.attention --seqs 32768,131072 --kv-heads 16,4 --repeats 10 \
            --warmup 3 --variants sdpa_cudnn,fa4,dca,dca_fa4,chunked_fa4 --profile dca_fa4 \
            --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1
          sed -n '/^| seq/,$p' "$OUT/attention.log" | head -40 ;;
    small) "$PYTHON" -m bench.attention --seqs 8192 --kv-heads 16,4 --repeats 10 --warmup 3 \
             --variants sdpa_cudnn,fa4,dca_small,dca_small_fa4 --out "$OUT/attention_8k.json" \
             > "$OUT/attention_8k.log" 2>&1
           "$PYTHON" -m bench.attention --seqs 8192 --kv-heads 16,4 --repeats 10 --warmup 3 \
             --variants sdpa_cudnn,fa4,dca_small,dca_small_fa4 --back-to-back 20 \
             --out "$OUT/attention_8k_b2b.json" >> "$OUT/attention_8k.log" 2>&1
           grep -E "^\| 8192" "$OUT/attention_8k.log" ;;
    graphs) "$PYTHON" -m bench.attention --seqs 8192,32768 --kv-heads 16,4 --repeats 10 \
              --warmup 3 --variants sdpa_cudnn,fa4,dca_small_graphs,dca_small_graphs_fa4,dca_graphs_fa4 \
              --out "$OUT/attention_graphs.json" > "$OUT/attention_graphs.log" 2>&1
            grep -E "^\| (8192|32768)" "$OUT/attention_graphs.log" ;;
    inplace) A=("$PYTHON" -m bench.attention --repeats 10 --warmup 3 --kv-heads 16,4)
             { "${A[@]}" --seqs 8192 --back-to-back 20 --out "$OUT/b8k.json" \
                 --variants sdpa_cudnn,fa4,dca_small_fa4_parts,dca_small_fa4,dca_small_fa4_one_call
               "${A[@]}" --seqs 32768,131072 --out "$OUT/long.json" --profile dca_fa4 \
                 --variants sdpa_cudnn,fa4,dca_fa4_parts,dca_fa4,dca_fa4_one_call --paired fa4
             } > "$OUT/bench.log" 2>&1
             grep -E "^\| (8192|32768|131072)" "$OUT/bench.log" ;;
    goals) "$PYTHON" bench/train.py --models gpt_1p3b --attention standard dca \
             --seqs 32768 131072 --steps 8 --warmup 3 --steps-for 131072:5:2 \
             --set trainer.fused_norm=true trainer.fused_rope=true logger=none \
             trainer.attention_kernel=fa4 --set-for 131072 trainer.recompute=full \
             --variant auto trainer.dca_backward=auto \
             --variant one_piece trainer.dca_backward=one_piece \
             --out "$OUT/train_dca.json" > "$OUT/train_dca.log" 2>&1
           grep -E "^\| gpt" "$OUT/train_dca.log"
           "$PYTHON" bench/fa4_goals.py --long "$OUT/long.json" --small "$OUT/b8k.json" \
             --train "$OUT/train_dca.json" --out "$OUT/goals.json" | tee "$OUT/goals.md" ;;
    train) "$PYTHON" bench/train.py --models gpt_1p3b --attention standard dca \
             --seqs 32768 131072 --steps 8 --warmup 3 --steps-for 131072:5:2 \
             --set trainer.fused_norm=true trainer.fused_rope=true logger=none \
             --set-for 131072 trainer.recompute=full \
             --variant cudnn trainer.attention_kernel=cudnn \
             --variant fa4 trainer.attention_kernel=fa4 \
             --out "$OUT/train.json" > "$OUT/train.log" 2>&1
           grep -E "^\| gpt" "$OUT/train.log" ;;
    firstuse) "$PYTHON" bench/first_use.py --out "$OUT/first_use.json" \
                > "$OUT/first_use.log" 2>&1
              sed -n '/^| attention/,$p' "$OUT/first_use.log" ;;
  esac
done
