"""The README's example: a GPT sharded per layer (ZeRO-3) and its whole training step - every
microbatch, FSDP's collectives, clipping, fused AdamW - captured as one CUDA graph.

    torchrun --nproc-per-node 2 examples/quickstart.py   # GPUs: NCCL, one graph per step
    torchrun --nproc-per-node 2 examples/quickstart.py   # CPU only: gloo, the same step eagerly
"""

import torch

from graph_fsdp import BufferPolicy, MixedPrecisionPolicy, fully_shard, init_distributed
from graph_fsdp.capture import StepPolicy, WholeStepGraph
from graph_fsdp.models import GPTConfig, build_model, synthetic_batch

rank = init_distributed().rank()  # NCCL with a GPU per rank, gloo on a CPU-only machine
device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
cfg = GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128)
model = build_model(cfg, device=device)
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device != "cpu" else None)
for layer in model.layers:
    fully_shard(layer, mp_policy=mp)  # ZeRO-3: fp32 main weights and grads, sharded
fully_shard(model, mp_policy=mp, buffer_policy=BufferPolicy(allocator="double_buffer"))
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
runner = WholeStepGraph(model, opt, policy=StepPolicy(clip_grad=1.0), eager=device == "cpu")


def step_fn(input_ids, labels, *, scale):  # one microbatch: forward and backward
    loss = model(input_ids, labels) * scale
    loss.backward()
    return loss.detach()


step = runner.capture(step_fn)  # eager for 2 warmup steps, then one graph replay per step
for i in range(10):
    out = step([synthetic_batch(cfg, 2, i, rank, device)], scale=1.0)
    if rank == 0:
        print(f"step {i} loss {out.loss.item():.4f} grad norm {out.grad_norm.item():.3f}")
