#!/usr/bin/env bash
# The workloads issue 30 timed before the engine work, each in its own process, one after another on an
# otherwise idle machine: wall time and peak resident memory per workload (GNU time), outputs in $OUT.
#   bash benchmarks/downstream.sh            # everything (about 30 minutes on the 2-core CPU)
#   ONLY="selfplay werewolf" bash benchmarks/downstream.sh
set -uo pipefail
OUT=${OUT:-downstream-out}
REPERTORY=${REPERTORY:-.venv/bin/repertory}
ONLY=${ONLY:-"selfplay bench werewolf social train"}
mkdir -p "$OUT"

run() {  # name, then the command
  local name=$1
  shift
  /usr/bin/time -f "$name wall_s=%e peak_rss_mb=%M" -o "$OUT/$name.time" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  echo "exit=$?" >>"$OUT/$name.time"
  awk '{ for (i = 1; i <= NF; i++) if ($i ~ /^peak_rss_mb=/) { split($i, a, "="); $i = "peak_rss_mb=" int(a[2] / 1024) } print }' \
    "$OUT/$name.time" | tr '\n' ' ' | tee -a "$OUT/summary.txt"
  echo | tee -a "$OUT/summary.txt"
}

for job in $ONLY; do
  case $job in
    # 8 self-play Trust-and-Split episodes at 48 tokens a turn (the "did not finish in 15 minutes")
    selfplay) run selfplay "$REPERTORY" bench rollout --env trust-and-split -n 8 --no-naive --json ;;
    # bench rollout's default workload, with the naive per-turn generate() baseline
    bench) run bench "$REPERTORY" bench rollout --json ;;
    # a Werewolf held-out evaluation: 16 kernels x both teams against the heuristic bots
    werewolf) run werewolf "$REPERTORY" eval base --env werewolf --vs heuristic -n 32 --constrained \
      --max-new-tokens 16 --json ;;
    # 12 social conversations x 10 turns, judged by the embedded model
    social) run social "$REPERTORY" eval base --env social -n 12 --judge local --fine-grained \
      --max-new-tokens 40 --option max_turns=10 --json ;;
    # make run's job: the default recipe
    train) run train "$REPERTORY" train --quiet --set output_dir="$OUT/runs" ;;
    *) echo "unknown job $job" >&2 ;;
  esac
done
