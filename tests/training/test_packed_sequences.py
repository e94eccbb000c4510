"""Packed variable-length documents (models/packed.py, training/packing.py): the packed step
against the documents run one by one (fp64), no leak across documents, padding that changes
nothing, the per-token loss over uneven microbatches and ranks (2 gloo ranks against the
unsharded reference), the first-fit loader, and the refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from graph_fsdp.models import GPTConfig, build_model
from graph_fsdp.models.packed import IGNORE_INDEX, PackedBatch, document_ids
from graph_fsdp.training.packing import (
    PackedData,
    PackingPolicy,
    PackStream,
    first_fit,
    pack_tensors,
    padding_fraction,
    synthetic_lengths,
)
from graph_fsdp.training.processes import spawn
from graph_fsdp.training.train import TrainConfig, run

SMALL = GPTConfig(vocab_size=97, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32)
MOE = dataclasses.replace(SMALL, num_experts=4, moe_router_topk=2)


def _model(config: GPTConfig = SMALL) -> torch.nn.Module:
    return build_model(config, dtype=torch.float64)


def _docs(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SMALL.vocab_size, (n,), generator=g) for n in lengths]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_step_equals_the_documents_one_by_one():
    """Loss sum and every gradient of a pack of 2 rows x 2-3 documents equal the documents
    run one at a time (input doc[:-1], labels doc[1:]) within 1e-12 in fp64."""
    model = _model()
    docs = _docs(5, 9, 3, 14, 2)
    batch = pack_tensors([docs[:3], docs[3:]], PackingPolicy(budget=32, max_documents=4))
    loss = model(*batch[:2], position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)
    loss.backward()
    packed = _grads(model)
    model.zero_grad()
    ref = sum(model(d[None, :-1], d[None, 1:]) * (len(d) - 1) for d in docs)
    ref.backward()
    assert batch.real_tokens().item() == sum(len(d) - 1 for d in docs)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=0, atol=1e-12, msg=name)


def _logits(model, batch: PackedBatch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)


def test_no_leak_across_documents():
    """Changing document A's tokens leaves document B's logits and loss the same bits; the
    logits of A's positions do move (the test sees a change when there is one)."""
    model = _model()
    a, b = _docs(7, 11)
    policy = PackingPolicy(budget=32, max_documents=3)
    before = pack_tensors([[a, b]], policy)
    after = pack_tensors([[torch.randint(0, SMALL.vocab_size, (7,)), b]], policy)
    la, lb = _logits(model, before), _logits(model, after)
    assert torch.equal(la[0, 7:18], lb[0, 7:18])
    assert not torch.equal(la[0, :7], lb[0, :7])
    loss_b = [
        torch.nn.functional.cross_entropy(x[0, 7:17], before.labels[0, 7:17], reduction="sum")
        for x in (la, lb)
    ]
    assert torch.equal(*loss_b)


def test_zero_length_slots_and_padding_tail_change_nothing():
    """The same documents with 2 vs 6 document slots (4 more zero-length ones) give the same
    bits; with a longer padding tail (budget 32 vs 24, the model's positions the same) the
    loss and gradients agree within 1e-12."""
    docs = _docs(6, 10, 4)
    model = _model()
    out = []
    for slots, budget in ((3, 32), (7, 32), (3, 24)):
        model.zero_grad()
        batch = pack_tensors([docs], PackingPolicy(budget=budget, max_documents=slots))
        loss = model(*batch[:2], position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)
        loss.backward()
        out.append((loss.detach(), _grads(model)))
    assert torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(out[0][1][n], out[1][1][n]) for n in out[0][1])
    torch.testing.assert_close(out[0][0], out[2][0], rtol=0, atol=1e-12)
    for name, g in out[0][1].items():
        torch.testing.assert_close(g, out[2][1][name], rtol=0, atol=1e-12)


def test_pack_layout():
    """cu_seqlens: D slots and the tail per row over the flattened tokens, zero-length slots
    repeating the tail's start; positions restart per document; the last token of every
    document and the tail carry no loss; every token belongs to exactly one document."""
    a, b, c = _docs(3, 4, 5)
    batch = pack_tensors([[a, b], [c]], PackingPolicy(budget=10, max_documents=3))
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 7, 10, 15, 15, 15, 20]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    assert (
        batch.labels[0].tolist()
        == [*a[1:].tolist(), IGNORE_INDEX, *b[1:].tolist()] + [IGNORE_INDEX] * 4
    )
    assert (
        document_ids(batch.cu_seqlens, 20).tolist()
        == [0] * 3 + [1] * 4 + [3] * 3 + [4] * 5 + [7] * 5
    )


def test_first_fit_splits_spills_and_refuses():
    policy = PackingPolicy(budget=10, max_documents=2)
    packs = list(first_fit(iter([4, 25, 3, 3, 3]), policy))
    pieces = sorted(p for pack in packs for p in pack)
    # The 25-token document is split at the budget: 10 + 10 + 5.
    assert [p for p in pieces if p[0] == 1] == [(1, 0, 10), (1, 10, 10), (1, 20, 5)]
    assert all(len(pack) <= 2 and sum(p[2] for p in pack) <= 10 for pack in packs)
    assert sum(p[2] for p in pieces) == 38  # every token once: nothing dropped
    with pytest.raises(ValueError, match="document 1 has 25 tokens, more than the budget of 10"):
        list(first_fit(iter([4, 25]), dataclasses.replace(policy, split_documents=False)))


def test_synthetic_packs_fill_the_budget():
    """Lognormal documents of mean 600 tokens: padding under 2% of budgets 2048 and 8192."""
    for budget, slots in ((2048, 16), (8192, 64)):
        policy = PackingPolicy(budget=budget, max_documents=slots)
        stream = PackStream(synthetic_lengths(policy, 0), policy)
        packs = [stream.pack(i) for i in range(64)]
        assert padding_fraction(packs, budget) < 0.02, budget


def test_documents_from_a_token_file(tmp_path):
    """Documents end at the end-of-document token (kept as their last token); a run past the
    file's packs is refused naming how many there are; without --eod-token-id it is refused."""
    eod = 0
    tokens = np.array([5, 6, eod, 7, 8, 9, eod, 10, 11, eod], dtype=np.uint16)
    path = tmp_path / "docs.bin"
    tokens.tofile(path)
    policy = PackingPolicy(budget=8, max_documents=2)
    data = PackedData(policy, vocab_size=16, data_path=path, eod_token_id=eod)
    batch = data.batch(1, 0, 0, 1, "cpu")
    assert batch.input_ids[0, :7].tolist() == [5, 6, eod, 7, 8, 9, eod]
    assert batch.cu_seqlens.tolist() == [0, 3, 7, 8]
    with pytest.raises(ValueError, match="make 2 packs of 8 tokens, and this run needs pack 2"):
        data.batch(1, 2, 0, 1, "cpu")
    with pytest.raises(ValueError, match="--eod-token-id"):
        PackedData(policy, vocab_size=16, data_path=path)


def _packed_runs(rank: int, world: int, cfg: TrainConfig) -> dict:
    fsdp = run(rank, world, cfg)
    whole = run(rank, world, dataclasses.replace(cfg, cuda_graph_optimizer=True))
    ref = run(rank, world, dataclasses.replace(cfg, mode="reference"))
    return {"fsdp": fsdp, "whole_step": whole, "reference": ref}


@pytest.mark.parametrize("model", [SMALL, MOE], ids=["dense", "moe"])
def test_per_token_loss_over_uneven_microbatches_and_ranks(model):
    """2 gloo ranks, 2 microbatches of packs with different numbers of real tokens: ZeRO-3
    (the loop's steps, and the whole-step runner's eager twin) trains like the unsharded
    reference on the same documents; the step loss is the mean over every real token of the
    step (not a mean of microbatch means)."""
    cfg = TrainConfig(
        model=model,
        packing=PackingPolicy(budget=32, max_documents=4, mean_document_length=9),
        steps=3,
        grad_accum=2,
        micro_batch_size=2,
        eval_interval=3,
        fused_optimizer=True,
    )
    out = spawn(_packed_runs, 2, cfg)
    for result in out:
        ref = result["reference"]
        for name in ("fsdp", "whole_step"):
            torch.testing.assert_close(result[name]["losses"], ref["losses"], rtol=2e-6, atol=0)
            torch.testing.assert_close(
                result[name]["eval_losses"], ref["eval_losses"], rtol=2e-6, atol=0
            )
            for p, value in ref["params"].items():
                torch.testing.assert_close(
                    result[name]["params"][p], value, rtol=1e-5, atol=1e-6, msg=p
                )
    # The first step's loss is the per-token mean over all 8 packs of step 0 (before any
    # update), computed here from the packs themselves.
    data = PackedData(cfg.packing, vocab_size=model.vocab_size)
    torch.manual_seed(model.seed)
    reference_model = build_model(model)
    total, tokens = 0.0, 0
    for index in range(2):  # microbatch 0 and 1 of step 0
        for rank in range(2):
            batch = data.batch(2, index, rank, 2, "cpu")
            with torch.no_grad():
                total += reference_model(
                    *batch[:2], position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens
                ).item()
            tokens += batch.real_tokens().item()
    assert out[0]["reference"]["losses"][0] == pytest.approx(total / tokens, rel=1e-5)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"tensor_parallel": 2}, "not supported with {'tensor_parallel': 2}"),
        ({"packing": PackingPolicy(budget=16)}, "budget=16 != GPTConfig.seq_length=32"),
    ],
)
def test_refusals_name_the_setting(change, match):
    with pytest.raises(ValueError, match=match.replace("{", r"\{").replace("}", r"\}")):
        TrainConfig(**{"model": SMALL, "packing": PackingPolicy(budget=32), **change})


def test_te_layers_refuse_packed_calls():
    model = build_model(SMALL)
    model.config = dataclasses.replace(SMALL, transformer_impl="transformer_engine")
    batch = pack_tensors([_docs(3, 4)], PackingPolicy(budget=32, max_documents=2))
    with pytest.raises(ValueError, match="transformer_impl='local'"):
        model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)


def test_huggingface_llama_packed_equals_the_documents_one_by_one():
    """HuggingFace Llama (random init) through graph_fsdp's CausalLM: positions restarting per
    document and a 4-D mask of attention within documents give the loss sum and gradients of
    the documents run one at a time, within 1e-10 in fp64."""
    pytest.importorskip("transformers")
    from graph_fsdp.integrations.hf_train import CausalLM
    from graph_fsdp.models.hf import hf_decoder

    torch.manual_seed(0)
    lm = hf_decoder("llama", vocab=97, hidden=32, intermediate=64, layers=2, heads=4, seq=32)
    model = CausalLM(lm.to(torch.float64))
    docs = _docs(6, 11, 4, 9)
    batch = pack_tensors([docs[:2], docs[2:]], PackingPolicy(budget=32, max_documents=3))
    loss = model(*batch[:2], position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens)
    loss.backward()
    packed = _grads(model)
    model.zero_grad()
    ref = sum(  # HuggingFace's own loss upcasts to fp32: the fp64 sum from its logits
        torch.nn.functional.cross_entropy(
            lm(input_ids=d[None], use_cache=False).logits[0, :-1], d[1:], reduction="sum"
        )
        for d in docs
    )
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-10)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed[name], p.grad, rtol=0, atol=1e-10, msg=name)


def _hf_runs(rank: int, world: int, cfg) -> dict:
    from graph_fsdp.integrations.hf_train import run as hf_run

    return {
        "fsdp": hf_run(rank, world, cfg),
        "reference": hf_run(rank, world, dataclasses.replace(cfg, mode="reference")),
    }


def test_huggingface_llama_packed_trains_like_the_reference():
    """2 gloo ranks, ZeRO-3, 2 microbatches of packs: the sharded Llama trains like the
    unsharded reference on the same documents (per-token loss over ranks and microbatches)."""
    pytest.importorskip("transformers")
    from graph_fsdp.integrations.hf_train import HFTrainConfig

    cfg = HFTrainConfig(
        seq_length=32,
        packing=PackingPolicy(budget=32, max_documents=4, mean_document_length=9),
        steps=3,
        grad_accum=2,
        eval_interval=3,
    )
    for result in spawn(_hf_runs, 2, cfg):
        ref = result["reference"]
        torch.testing.assert_close(result["fsdp"]["losses"], ref["losses"], rtol=2e-6, atol=0)
        torch.testing.assert_close(
            result["fsdp"]["eval_losses"], ref["eval_losses"], rtol=2e-6, atol=0
        )
        for p, value in ref["params"].items():
            torch.testing.assert_close(result["fsdp"]["params"][p], value, rtol=1e-5, atol=1e-6)
