#!/usr/bin/env bash
# The GPU test suite in chunks that fit a remote command's time limit (the GPU host's device
# tool stops a command at 600 s), each with its own limit, one summary per chunk.
#
#   bash tools/gpu_tests.sh [CHUNK ...]     # default: every chunk, in this order
#
# Chunks (2x H200, 2026-11-23): megatron (test_megatron_gpu.py but its seq-64 attention
# checks, ~6 min), megatron_attn (those checks, ~2 min), te (the
# TransformerEngine-layer model of test_cuda_graphs_gpu.py), graphs (the rest of it),
# third_party, hf_families (the sweep over HuggingFace decoder families, ~2.5 min at world 1),
# capture_safety, lifecycle, hsdp, fully_shard, expert_parallel (its 2- and 4-GPU layouts skip
# on fewer GPUs), megatron_ep (Megatron-Core MoE GPT with expert parallelism: EP 1 through the
# expert mesh, EP 2 and checkpoints across EP sizes; 2-GPU parts skip on one), megatron_ep4 (its
# 4-GPU layouts, EP 2 x EDP 2 and EP 4), megatron_ep_dropless (its dropless grouped_mm experts
# over EP 2, captured whole; the EP 2 x EDP 2 layout skips below 4 GPUs), bench, comm_graphs (real communication-graph replays,
# also at world size 1), whole_step (the one-graph training step: bit-exactness and the timing
# rows, ~4 min at world 1), tensor_parallel (DTensor and Megatron-Core TP with FSDP; needs 2 or 4
# GPUs, skips on one), rl_offload (examples/rl_loop.py per graph scope and ZeRO level under
# torch-memory-saver, ~2 min at world 1), rl_offload_1b (its 1B-parameter measurement, ~1 min);
# both measure the device's free memory: give each a GPU no other lane uses; fi_pool
# (full_iteration's main gradients in its graph's pool, 1 GPU), packed (packed variable-length
# documents under every capture mode, 200 steps, ~3 min at world 2), megatron_packed (packed
# documents through a Megatron-Core GPT with TE's THD attention: every capture mode at world 1
# and 2, TP 2 + sequence parallelism, 200 steps each, and attention within documents; 2-GPU
# parts skip on one), megatron_hybrid (a Megatron-Core
# HybridModel with attention, MLP and MoE layers under every capture mode at world 1 and 2;
# its Mamba pattern skips where mamba_ssm / causal_conv1d do not import).
# Logs go to $OUT/gpu_<chunk>.log (OUT defaults to ./gpu_tests_out; BUNDLE=<file.tgz> also packs
# them into one archive, for a runner that returns few files); each chunk prints its PASSED /
# FAILED / SKIPPED lines and pytest's summary line. The NVLink-multicast switches stay off.
# WORLD=1 runs the 2-rank tests with one rank on one GPU (a smoke run on a single-GPU
# machine: GRAPH_FSDP_GPU_TEST_WORLD, tests/graph_fsdp_testing.py); tests that need 2 ranks skip.
#
# Every log starts with the commit it tested (graph_fsdp/bench/provenance.py [Note:
# provenance]): git where the tree has .git, else GRAPH_FSDP_COMMIT, which the caller sets on
# a host that receives the tree without .git:
#   GRAPH_FSDP_COMMIT=<output of `git describe --always --dirty --abbrev=40`> bash tools/gpu_tests.sh
# A chunk passes only if pytest exits 0: exit 5 (no test collected, e.g. a keyword that
# matches nothing) is a failure, like any other.
set -u -o pipefail

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore GRAPH_FSDP_GPU_TEST_WORLD="${WORLD:-2}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu_tests_out}"
mkdir -p "$OUT"

declare -A LIMIT=(
  [megatron]=560 [megatron_attn]=300 [te]=300 [graphs]=400 [third_party]=540 [hf_families]=560 [capture_safety]=300
  [lifecycle]=300 [hsdp]=300 [fully_shard]=400 [expert_parallel]=560 [megatron_ep]=560
  [megatron_ep4]=560 [megatron_ep_dropless]=560 [bench]=400 [comm_graphs]=300 [whole_step]=480
  [tensor_parallel]=560 [rl_offload]=560 [rl_offload_1b]=560 [fi_pool]=300 [packed]=300 [megatron_packed]=560
  [megatron_hybrid]=560
)
declare -A ARGS=(
  [megatron]="tests/integrations/test_megatron_gpu.py -k not seq_64"
  [megatron_attn]="tests/integrations/test_megatron_gpu.py -k seq_64"
  [te]="tests/capture/test_cuda_graphs_gpu.py -k te_layers"
  [graphs]="tests/capture/test_cuda_graphs_gpu.py -k not te_layers"
  [third_party]="tests/core/test_third_party_gpu.py -k not families"
  [hf_families]="tests/core/test_third_party_gpu.py -k families"
  [capture_safety]="tests/capture/test_capture_safety_gpu.py"
  [lifecycle]="tests/lifecycle/test_lifecycle_gpu.py"
  [hsdp]="tests/core/test_hsdp_gpu.py"
  [fully_shard]="tests/core/test_fully_shard_gpu.py"
  [expert_parallel]="tests/core/test_expert_parallel_gpu.py"
  [megatron_ep]="tests/integrations/test_megatron_ep_gpu.py -k not world4 and not grouped_mm"
  [megatron_ep4]="tests/integrations/test_megatron_ep_gpu.py -k world4 and not grouped_mm"
  [megatron_ep_dropless]="tests/integrations/test_megatron_ep_gpu.py -k grouped_mm"
  [bench]="tests/bench/test_bench_gpu.py"
  [comm_graphs]="tests/capture/test_comm_graphs_gpu.py"
  [whole_step]="tests/capture/test_whole_step_gpu.py"
  [tensor_parallel]="tests/core/test_tensor_parallel_gpu.py"
  [rl_offload]="tests/lifecycle/test_rl_offload_gpu.py -k not 1b"
  [rl_offload_1b]="tests/lifecycle/test_rl_offload_gpu.py -k 1b"
  [fi_pool]="tests/capture/test_full_iteration_pool_gpu.py"
  [packed]="tests/training/test_packed_sequences_gpu.py"
  [megatron_packed]="tests/integrations/test_megatron_packed_gpu.py"
  [megatron_hybrid]="tests/integrations/test_megatron_hybrid_gpu.py"
)
CHUNKS=("$@")
((${#CHUNKS[@]})) || CHUNKS=(megatron megatron_attn te graphs third_party hf_families capture_safety lifecycle hsdp fully_shard expert_parallel megatron_ep megatron_ep4 megatron_ep_dropless bench comm_graphs whole_step tensor_parallel rl_offload rl_offload_1b fi_pool packed megatron_packed megatron_hybrid)

# The header of every log: the commit, the machine, the versions.
STAMP="$(python -m graph_fsdp.bench.provenance 2>&1)"
MACHINE="$(python -c 'import torch
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"torch {torch.__version__}, {len(gpus)} GPU(s): {chr(44).join(gpus) or chr(45)}")' 2>&1)"
echo "# code: $STAMP"
echo "# machine: $MACHINE; GRAPH_FSDP_GPU_TEST_WORLD=$GRAPH_FSDP_GPU_TEST_WORLD"

status=0
for chunk in "${CHUNKS[@]}"; do
  if [[ -z "${ARGS[$chunk]:-}" ]]; then
    echo "unknown chunk $chunk (one of: ${!ARGS[*]})" >&2
    status=2
    continue
  fi
  log="$OUT/gpu_$chunk.log"
  read -r -a files <<<"${ARGS[$chunk]%% -k *}"
  keyword=""
  [[ ${ARGS[$chunk]} == *" -k "* ]] && keyword="${ARGS[$chunk]#* -k }"
  {
    echo "# chunk $chunk, $(date -u +%FT%TZ)"
    echo "# code: $STAMP"
    echo "# machine: $MACHINE; GRAPH_FSDP_GPU_TEST_WORLD=$GRAPH_FSDP_GPU_TEST_WORLD"
  } >"$log"
  timeout "${LIMIT[$chunk]}" python -m pytest -q -rA -s -p no:cacheprovider -m gpu \
    "${files[@]}" ${keyword:+-k "$keyword"} >>"$log" 2>&1
  rc=$?
  ((rc == 0)) || status=1  # 5 (nothing collected) fails too: a chunk must run its tests
  case $rc in
    0) verdict=passed ;;
    5) verdict="FAILED: no test collected" ;;
    124) verdict="FAILED: stopped at its ${LIMIT[$chunk]} s limit" ;;
    *) verdict=FAILED ;;
  esac
  echo "===== $chunk (rc=$rc, $verdict)"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^[0-9]+ (passed|failed)|[0-9]+ (passed|failed|skipped).* in " "$log" | tail -40
done
# BUNDLE=<file.tgz>: every chunk log in one archive (a remote runner may return few files).
if [[ -n "${BUNDLE:-}" ]]; then
  tar czf "$BUNDLE" -C "$OUT" . || status=1
fi
exit $status
