"""Helpers to run real multi-process groups (gloo on CPU, NCCL on GPUs) in tests and tools."""

from __future__ import annotations

import gc
import io
import os
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection as mp_connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graph_fsdp.distributed import init_distributed

GPU_TEST_WORLD = int(os.environ.get("GRAPH_FSDP_GPU_TEST_WORLD", "2"))
"""Ranks (one GPU each) the multi-GPU tests spawn: 2, or 1 for a single-GPU smoke run
(``GRAPH_FSDP_GPU_TEST_WORLD=1``, tools/gpu_tests.sh ``WORLD=1``); the tests that need
several ranks by construction skip below 2."""


def needs_gpus(world: int | None = None):
    """``skipif`` marker: fewer CUDA GPUs than ``world`` (default ``GPU_TEST_WORLD``)."""
    import pytest  # noqa: PLC0415 (tests only)

    world = GPU_TEST_WORLD if world is None else world
    return pytest.mark.skipif(
        torch.cuda.device_count() < world, reason=f"needs {world} CUDA GPU(s)"
    )


HF_DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # biased q/k/v projections; tied embedding and output layer (as Qwen2-0.5B)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),  # top-2 MoE
    # Learned positions, LayerNorm + GELU, Conv1D projections, tied by default, layers in
    # ``transformer.h`` and attention named ``attn``.
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    # Parallel residual, partial rotary, attention named ``attention``, untied ``embed_out``.
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # q/k RMSNorm per head
    # MoE, top-2 of 4 experts, the router at ``mlp.gate``
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4}),
    # + a shared expert with its own sigmoid gate
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4}),
    # Multi-head latent attention; the first layer dense, the others MoE (router ``mlp.gate``
    # with a bias-corrected top-k); attention heads only (no grouping)
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "n_routed_experts": 4,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
        },
    ),
    # Embedding scaled by sqrt(hidden), (1 + w) RMSNorm, tied
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    # Logit soft-capping, sandwich norms, alternating sliding-window layers (eager attention)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attn_implementation": "eager"}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 32}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv and gate/up projections
    "phi": ("PhiConfig", "PhiForCausalLM", {}),  # parallel attention + MLP, partial rotary
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # norms after attention and MLP
    # Parallel attention + MLP (new decoder architecture), ``self_attention``
    "falcon": ("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": True}),
    # Learned positions with an offset, no ``mlp`` module (``fc1``/``fc2`` on the layer)
    "opt": ("OPTConfig", "OPTForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    # Multi-query attention with fused c_attn, layers in ``transformer.h``
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {"multi_query": True}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),  # scaled residuals and logits
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),  # parallel block, LayerNorm
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),  # partial rotary, LayerNorm
    # MoE with attention sinks, clamped SwiGLU, the router at ``mlp.router`` (eager attention)
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"num_local_experts": 4, "sliding_window": 32, "attn_implementation": "eager"},
    ),
}
"""HuggingFace decoder families the tests train: (config class, model class, its settings).
:func:`hf_decoder` sizes them alike; a family the installed transformers lacks is skipped
(:func:`hf_family_available`)."""

_HF_SIZE_ALIASES = (
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "ffn_dim",
    "ffn_hidden_size",
    "n_inner",
)
"""Config fields that size an MLP or expert under another name (a config ignores the fields
it does not have): all set to ``intermediate``."""


def hf_family_available(family: str) -> bool:
    """The installed transformers has ``family``'s config and model classes."""
    import transformers  # noqa: PLC0415 (tests only)

    config_cls, model_cls, _ = HF_DECODERS[family]
    return hasattr(transformers, config_cls) and hasattr(transformers, model_cls)


def hf_decoder(
    family: str,
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    seq: int,
    **config,
):
    """A HuggingFace causal LM of ``family`` (:data:`HF_DECODERS`; random init from seed 0, no
    download, SDPA attention unless the family says otherwise, 2 key/value heads, head size
    ``hidden / heads``, top-2 routing, every MLP and expert of width ``intermediate``);
    ``config`` adds or overrides settings."""
    import transformers  # noqa: PLC0415 (tests only)

    config_cls, model_cls, extra = HF_DECODERS[family]
    head = hidden // heads
    if family == "deepseek_v3":  # latent attention: its own head sizes, no key/value groups
        sizes = {"qk_rope_head_dim": head // 2, "qk_nope_head_dim": head // 2, "v_head_dim": head}
        sizes["num_key_value_heads"] = heads
    else:
        sizes = {"num_key_value_heads": 2, "num_kv_heads": 2}  # Falcon's name for it
        if not isinstance(getattr(getattr(transformers, config_cls), "head_dim", None), property):
            sizes["head_dim"] = head  # Falcon derives it
    settings = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        **{k: intermediate for k in _HF_SIZE_ALIASES},
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": seq,
        "attn_implementation": "sdpa",
        "num_experts_per_tok": 2,
        **sizes,
        **extra,
        **config,
    }
    cfg = getattr(transformers, config_cls)(**settings)
    for special in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, special, None)
        if isinstance(value, int) and value >= vocab and special not in config:
            setattr(cfg, special, None)  # past the small vocabulary (Phi-3's padding id)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg)


def hf_decoder_layers(model) -> list:
    """A HuggingFace causal LM's decoder layers (``transformer.h``, ``model.layers`` or OPT's
    ``model.decoder.layers``)."""
    base = model.base_model
    base = getattr(base, "decoder", base)
    return base.h if hasattr(base, "h") else base.layers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    fn: Callable,
    world_size: int,
    port: int,
    backend: str,
    args: tuple,
    conn,
    pg_timeout_s: float | None,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    ok = False
    if backend == "gloo":
        # One intra-op thread per rank, as torchrun's default OMP_NUM_THREADS=1: several ranks
        # on a few cores oversubscribe them, and multi-threaded CPU kernels (MKL, OpenMP) can
        # then sum in another order from run to run, which breaks bit-exact comparisons
        # between two launches (seen twice in CI-like runs on 2 cores).
        torch.set_num_threads(1)
    try:
        if backend == "nccl":
            from graph_fsdp.capture.te_backend import preload_te  # noqa: PLC0415

            preload_te()
        init_distributed(backend, timeout_s=pg_timeout_s, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()  # plain bytes: shared-memory tensors die with the child
        torch.save(result, buf)
        conn.send(("ok", buf.getvalue()))
        ok = True
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        conn.close()
        if ok and dist.is_initialized():
            # Collect cycles that keep the engine (and its group) alive first, so that the group
            # really is destroyed here, not by a gloo thread during interpreter shutdown.
            gc.collect()
            dist.destroy_process_group()


DEAD_GRACE_S = 3.0
"""A rank that exited this long ago without reporting died (killed, os._exit, a crash)."""
FAIL_GRACE_S = 90.0
"""After a failure, how long the other ranks get to report (their errors) before they are
terminated: longer than the default process-group timeout, so a rank waiting on a dead peer
fails on its own first."""


def spawn(
    fn: Callable,
    world_size: int = 2,
    *args,
    backend: str = "gloo",
    timeout: float | None = None,
    pg_timeout_s: float | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return results.

    ``fn`` must be importable (module level). The groups are made by
    :func:`graph_fsdp.init_distributed` with ``pg_timeout_s`` (None: its default, 60 s). Never hangs: a rank that exits
    without reporting, or a run past ``timeout`` seconds (None: no bound), fails the call. Raises with every
    failing rank's traceback (and the ranks that died or were terminated).
    """
    for attempt in range(PORT_ATTEMPTS):
        outcome = _launch(fn, world_size, args, backend, timeout, pg_timeout_s)
        if not (_port_taken(outcome) and attempt + 1 < PORT_ATTEMPTS):
            break
    failures = [
        f"rank {r} failed:\n{payload}" for r, (status, payload) in outcome.items() if status != "ok"
    ]
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        failures.append(f"ranks {missing} did not finish in time and were terminated")
    if failures:
        raise RuntimeError("\n".join(failures))
    return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]


PORT_ATTEMPTS = 3
"""``free_port`` only finds a port free at that moment: another process (an NCCL bootstrap of
a parallel job) can take it before rank 0 listens. Such a launch is retried on a new port."""


def _port_taken(outcome: dict) -> bool:
    return any(
        status != "ok" and "EADDRINUSE" in str(payload) for status, payload in outcome.values()
    )


def _launch(fn, world_size, args, backend, timeout, pg_timeout_s) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, fn, world_size, port, backend, args, pipes[r][1], pg_timeout_s),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for _, child_end in pipes:
        child_end.close()
    outcome = _collect(procs, [parent for parent, _ in pipes], timeout)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    return outcome


def _collect(procs: list, conns: list, timeout: float | None) -> dict[int, tuple[str, object]]:
    """Each rank's ``(status, payload)`` as it arrives; stops when every rank is accounted
    for, ``FAIL_GRACE_S`` after the first failure, or at ``timeout``."""
    start = time.monotonic()
    outcome: dict[int, tuple[str, object]] = {}
    exited_at: dict[int, float] = {}
    first_failure: float | None = None
    while len(outcome) < len(procs):
        now = time.monotonic()
        if (timeout is not None and now - start > timeout) or (
            first_failure and now - first_failure > FAIL_GRACE_S
        ):
            break
        pending = {conns[r]: r for r in range(len(procs)) if r not in outcome}
        for conn in mp_connection.wait(list(pending), timeout=0.5):
            r = pending[conn]
            try:
                outcome[r] = conn.recv()
            except EOFError:  # closed without a message: the rank died
                continue
            if outcome[r][0] != "ok" and first_failure is None:
                first_failure = time.monotonic()
            if _port_taken({r: outcome[r]}):
                return outcome  # the peers wait for a store that never listens: retry now
        for r, p in enumerate(procs):
            if r in outcome or p.is_alive():
                continue
            exited_at.setdefault(r, time.monotonic())
            if time.monotonic() - exited_at[r] > DEAD_GRACE_S:
                outcome[r] = (
                    "died",
                    f"exited with code {p.exitcode} without reporting (killed, os._exit or a "
                    "crash); the other ranks' collectives with it fail (see their errors)",
                )
                first_failure = first_failure or time.monotonic()
    return outcome


def cli_error(capsys, *argv: str) -> str:
    """The message ``graph-fsdp argv`` stops with (a CLIError: exit code 2), on one line.

    ``capsys`` is pytest's fixture; the command runs in this process, so nothing is launched
    when the arguments are refused before that.
    """
    from graph_fsdp.cli.main import main  # noqa: PLC0415 (the CLI imports much)

    try:
        main(list(argv))
    except SystemExit as exc:
        assert exc.code == 2, f"graph-fsdp {' '.join(argv)} exited with {exc.code}, not 2"
    else:
        raise AssertionError(f"graph-fsdp {' '.join(argv)} was not refused")
    err = capsys.readouterr().err
    assert "error:" in err, err
    return err.split("error:", 1)[1].replace("\n", " ")


def saved_tensor_bytes(fn: Callable[[], object], exclude=()) -> tuple[object, int]:
    """``(fn(), bytes)``: the bytes of the tensors autograd keeps for backward while ``fn``
    runs (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once (views and
    chunks of one tensor share it) and the storages of ``exclude`` (parameters) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()  # alive until backward: no reuse
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())
