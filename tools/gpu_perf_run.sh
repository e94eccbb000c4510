#!/usr/bin/env bash
# One GPU measurement run (speed and memory at realistic scale), ~6-8 min on 2x H200 (torch
# backend; TransformerEngine not needed), never more than BUDGET=540 s:
#
#   1. graph-fsdp bench at h1024 (16 layers, seq 1024, mbs 1, vocab 32768) and h2048
#      (seq 2048, mbs 2): unsharded eager, unsharded captured (the ratios' denominator is the
#      faster of the two), graph_fsdp eager, layerwise torch graphs, full_iteration, torch
#      FSDP2, FSDP2 + captured fwd/bwd, megatron_fsdp (skipped when not importable); bf16
#      compute, fp32 main weights and fp32 gradient reduction, fused AdamW in every row (the
#      bench's default); 5 warmup + 20 timed steps. Every row reports its own peak memory
#      (allocated and reserved) and a graphed row its replays (graph_fsdp/bench/verdicts.py).
#      SHAPES="h4096" adds the larger shape (8 layers, hidden 4096, seq 4096, mbs 1).
#   2. graph-fsdp profile --memory at h2048 (MEMORY_SHAPES="h1024 h2048" for both): graph_fsdp
#      eager (double buffer and dynamic allocator), graph_fsdp full_iteration, torch FSDP2
#      eager; bytes at the peak by role.
#   3. host time of a layerwise step per layer (tools/host_overhead.py --real, tiny and h1024)
#      and per per-layer operation (tools/nccl_host_cost.py); HOST=0 skips it.
#
# Usage (repo root; results go to $OUT, default ./gpu_perf_out):
#   OUT=/some/dir bash tools/gpu_perf_run.sh
#   DRY=1 bash tools/gpu_perf_run.sh      # tiny shapes on CPU (gloo): checks the plumbing
#
# $OUT ends up with summary.md (the bench and memory tables), bench_<shape>.md and
# memory_<shape>.md per shape, log.txt and results.tar.gz (every JSON/MD/PNG). log.txt and
# summary.md start with the commit measured (graph_fsdp/bench/provenance.py): git where the
# tree has .git, else GRAPH_FSDP_COMMIT (set it where git is, e.g.
# GRAPH_FSDP_COMMIT=$(git describe --always --dirty --abbrev=40)), else "unknown".
set -u -o pipefail
shopt -s nullglob

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONWARNINGS="ignore::FutureWarning"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

OUT="${OUT:-$PWD/gpu_perf_out}"
WORK="$OUT/work"
mkdir -p "$WORK"
LOG="$OUT/log.txt"
: >"$LOG"
CLI=(python -m graph_fsdp.cli.main)

if [[ "${DRY:-0}" == "1" ]]; then
  DEV=(--device cpu --nproc 2)
  H1=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 128
      --micro-batch-size 1)
  H2=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 128
      --micro-batch-size 2)
  H4=(--num-layers 2 --hidden-size 64 --num-attention-heads 8 --seq-length 64 --vocab-size 128
      --micro-batch-size 1)
  STEPS=(--train-iters 2 --warmup-iters 3)
  LIMIT=300
  BUDGET="${BUDGET:-100000}"
else
  DEV=(--device cuda)
  H1=(--num-layers 16 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
      --vocab-size 32768 --micro-batch-size 1)
  H2=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
      --vocab-size 32768 --micro-batch-size 2)
  # The larger shape: the unsharded step (fp32 weights, grads, AdamW state: ~30 GB, plus
  # activations) still fits one GPU.
  H4=(--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096
      --vocab-size 32768 --micro-batch-size 1)
  STEPS=(--train-iters 20 --warmup-iters 5)
  LIMIT=200
fi
COMMON=(--bf16 --fsdp-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail "${DEV[@]}")
# ROWS="..." / SHAPES="h2048" / MEMORY=0 narrow the run (e.g. to fit what is left of a budget);
# BENCH_FLAGS="--ddp-reduce-scatter-with-fp32-accumulation" adds flags to every bench launch.
read -r -a ROWS <<<"--rows ${ROWS:-unsharded unsharded_captured graph_fsdp graph_fsdp_graphed fsdp2 fsdp2_cuda_graph megatron_fsdp}"
read -r -a SHAPE_LIST <<<"${SHAPES:-h1024 h2048}"

# The device tool stops a command at 600 s: every step gets at most LIMIT seconds and what
# is left of BUDGET (bundling the results at the end needs a few seconds), so the summary
# and the tarball are always written.
BUDGET="${BUDGET:-540}"
step() {  # step NAME CMD...: run with a time limit, log everything, never stop the script
  local name="$1"
  shift
  local left=$((BUDGET - SECONDS))
  local limit=$((left < LIMIT ? left : LIMIT))
  if ((limit < 30)); then
    echo "=== $name: rc=skipped (only ${left} s of the ${BUDGET} s budget left)" | tee -a "$LOG"
    return
  fi
  echo "=== $name (limit ${limit} s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

STAMP="$(python -m graph_fsdp.bench.provenance 2>&1)"
echo "# code: $STAMP" >>"$LOG"
python - >>"$LOG" 2>&1 <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(" ", i, torch.cuda.get_device_name(i))
try:
    import megatron_fsdp
    print("megatron_fsdp", getattr(megatron_fsdp, "__version__", "?"))
except Exception as err:
    print("megatron_fsdp not importable:", err)
EOF

shape_args() {  # shape_args NAME: the model flags of a shape into S
  case $1 in
    h1024) S=("${H1[@]}") ;;
    h2048) S=("${H2[@]}") ;;
    h4096) S=("${H4[@]}") ;;
    *) echo "unknown shape $1 (h1024, h2048 or h4096)" | tee -a "$LOG"; return 1 ;;
  esac
}

for shape in "${SHAPE_LIST[@]}"; do
  shape_args "$shape" || continue
  step "bench $shape" "${CLI[@]}" bench "${COMMON[@]}" "${S[@]}" "${STEPS[@]}" \
    --graph-impls torch --scopes "" --scopes full_iteration "${ROWS[@]}" \
    ${BENCH_FLAGS:-} --output-dir "$WORK/bench_$shape"
  cp "$WORK/bench_$shape/results.md" "$OUT/bench_$shape.md" 2>/dev/null
done

# MEMORY_SHAPES="h1024 h2048" profiles memory at both shapes (default h2048).
read -r -a MEMORY_SHAPE_LIST <<<"${MEMORY_SHAPES:-h2048}"
if [[ "${MEMORY:-1}" == "1" ]]; then
for shape in "${MEMORY_SHAPE_LIST[@]}"; do
  shape_args "$shape" || continue
  MEM_STEPS=(--warmup-iters 3 --train-iters 2 --output-dir "$WORK/memory_$shape")
  step "memory $shape graph_fsdp eager (double buffer)" "${CLI[@]}" profile --memory graph_fsdp \
    "${COMMON[@]}" "${S[@]}" "${MEM_STEPS[@]}" --memory-label graph_fsdp_eager_db
  step "memory $shape torch FSDP2 eager" "${CLI[@]}" profile --memory fsdp2 --bf16 "${DEV[@]}" \
    "${S[@]}" "${MEM_STEPS[@]}" --memory-label fsdp2_eager
  if [[ "${DRY:-0}" != "1" ]]; then  # CUDA graphs need CUDA
    step "memory $shape graph_fsdp full_iteration" "${CLI[@]}" profile --memory graph_fsdp \
      "${COMMON[@]}" "${S[@]}" "${MEM_STEPS[@]}" --cuda-graph-impl torch \
      --cuda-graph-scope full_iteration --memory-label graph_fsdp_full_iteration
  fi
  step "memory $shape graph_fsdp eager (dynamic allocator)" "${CLI[@]}" profile --memory \
    graph_fsdp --bf16 "${DEV[@]}" "${S[@]}" "${MEM_STEPS[@]}" \
    --memory-label graph_fsdp_eager_dynamic
  python -m graph_fsdp.bench.memory "$WORK/memory_$shape"/memory_*.json \
    >"$OUT/memory_$shape.md" 2>>"$LOG"
done
python -m graph_fsdp.bench.memory_model >"$WORK/memory_model.md" 2>>"$LOG"
fi

# HOST=1 (default on GPUs): the host time per layer of a layerwise step at h1024 and tiny
# (tools/host_overhead.py --real), and per per-layer operation (tools/nccl_host_cost.py).
if [[ "${HOST:-1}" == "1" && "${DRY:-0}" != "1" ]]; then
  NPROC="${NPROC:-2}"
  for model in tiny h1024; do
    args=(--steps 300)
    [[ $model == h1024 ]] && args=(--hidden 1024 --heads 16 --seq 1024 --vocab 32768 --steps 40)
    for comm in "" --no-comm-graphs; do
      step "host per layer ($model${comm:+, $comm})" torchrun --nproc-per-node "$NPROC" \
        tools/host_overhead.py --real --bf16 "${args[@]}" $comm
    done
  done
  step "host per operation" torchrun --nproc-per-node "$NPROC" tools/nccl_host_cost.py
fi

{
  echo "# GPU measurement run ($(date -u +%FT%TZ))"
  echo
  echo "Code: $STAMP"
  for f in "$OUT"/bench_h*.md; do
    [[ -f $f ]] && { echo; cat "$f"; }
  done
  echo
  for f in "$OUT"/memory_h*.md; do
    echo "## Memory at the peak by role, $(basename "$f" .md | sed 's/memory_//') (graph-fsdp profile --memory, rank 0)"
    echo
    cat "$f"
  done
  echo
  if grep -q "host us/layer\|^# host us per call" "$LOG"; then
    echo "## Host time (tools/host_overhead.py --real, tools/nccl_host_cost.py)"
    echo
    echo '```'
    grep -A14 "host us/layer\|^# host us per call" "$LOG" | grep -v "^W1\|OMP_NUM\|\*\*\*\*"
    echo '```'
    echo
  fi
  echo "## Step results (rc per step)"
  grep '^=== .*rc=' "$LOG" | sed 's/$/  /'

} >"$OUT/summary.md"

tar -czf "$OUT/results.tar.gz" -C "$WORK" . && rm -rf "$WORK"
ls -la "$OUT" | tee -a "$LOG"
