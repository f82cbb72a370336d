#!/usr/bin/env bash
# PP=2 vs TP=2 vs CP=2 vs DP=2 on two GPUs: tokens/s, MFU and memory per GPU of each layout,
# written as one JSON table to $OUT/layouts.json (the metrics row of the last logged step).
#
#   OUT=out bash bench/layouts.sh                              # gpt_1p3b at 32K on 2 GPUs
#   OUT=out MODEL=tiny SEQ=256 STEPS=3 EXTRA="trainer.device=cpu" bash bench/layouts.sh  # CPU check
set -euo pipefail
OUT=${OUT:?set OUT to the output directory}
MODEL=${MODEL:-gpt_1p3b}
SEQ=${SEQ:-32768}
STEPS=${STEPS:-10}
NPROC=${NPROC:-2}
EXTRA=${EXTRA:-}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"

declare -A LAYOUTS=(
  [pp2]="parallel.pp=2"
  [tp2]="parallel.tp=2"
  [cp2]="parallel.cp=2"
  [dp2]="parallel.distributed_optimizer=true"
)
for name in pp2 tp2 cp2 dp2; do
  # One sequence per GPU per micro-batch; every layout processes the same 4 sequences a step.
  # shellcheck disable=SC2086
  "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --standalone -m trainer \
    model="$MODEL" trainer.seq_length="$SEQ" trainer.micro_batch_size=1 \
    trainer.global_batch_size=4 trainer.max_steps="$STEPS" trainer.warmup_steps=1 \
    trainer.log_interval=1 trainer.eval_interval=0 checkpoint.save=false logger=none \
    ${LAYOUTS[$name]} $EXTRA hydra.run.dir="$OUT/$name" > "$OUT/$name.log" 2>&1 \
    || echo "$name failed, see $OUT/$name.log" >&2
done

"$PYTHON" - "$OUT" "$MODEL" "$SEQ" <<'PY'
import json, sys
from pathlib import Path
out, model, seq = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
table = []
for name in ("pp2", "tp2", "cp2", "dp2"):
    metrics = out / name / "metrics.jsonl"
    if not metrics.exists():
        table.append({"layout": name, "error": f"no metrics, see {name}.log"})
        continue
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = rows[-1]
    table.append({"layout": name, "step": last["step"], "tokens_per_s": last["tokens_per_s"],
                  "mfu": last.get("mfu"), "tflops_per_gpu": last["tflops_per_gpu"],
                  "memory_gb_per_gpu": last["memory_gb"], "step_time_s": last["step_time_s"]})
(out / "layouts.json").write_text(json.dumps({"model": model, "seq_length": seq,
                                              "layouts": table}, indent=2))
print(json.dumps(table, indent=2))
PY
