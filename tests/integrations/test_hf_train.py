"""HuggingFace decoders through the one training loop (integrations/hf_train.py) on 2 gloo
ranks: graph_fsdp per decoder layer trains like the loop's unsharded mixed-precision reference
placement on the global batch (dense, tied embeddings, MoE), with accumulation, clipping by
the global norm and eval passes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graph_fsdp.integrations.hf_train import HFTrainConfig, run
from graph_fsdp.models.hf import hf_family_available
from graph_fsdp.training.processes import spawn

pytest.importorskip("transformers")

FAMILIES = tuple(f for f in ("llama", "qwen2", "mixtral") if hf_family_available(f))
BASE = HFTrainConfig(steps=3, grad_accum=2, clip_grad=0.05, eval_interval=2)


# The vocab-parallel input embedding (vocab_parallel.py) on the untied families; a tied one
# (qwen2 here) is refused.
VOCAB_PARALLEL = tuple(f for f in ("llama", "mixtral") if f in FAMILIES)


def _sharded(rank: int, world: int) -> dict:
    out = {f: run(rank, world, dataclasses.replace(BASE, family=f)) for f in FAMILIES}
    for f in VOCAB_PARALLEL:
        cfg = dataclasses.replace(BASE, family=f, vocab_parallel_embedding=True)
        out[f"{f}:vocab_parallel"] = run(rank, world, cfg)
    if "qwen2" in FAMILIES:
        try:
            run(
                rank,
                world,
                dataclasses.replace(BASE, family="qwen2", vocab_parallel_embedding=True),
            )
        except ValueError as err:
            out["qwen2:vocab_parallel"] = str(err)
    return out


@pytest.fixture(scope="module")
def sharded() -> list[dict]:
    return spawn(_sharded, 2)  # one launch for every family


@pytest.mark.parametrize("family", [*FAMILIES, *(f"{f}:vocab_parallel" for f in VOCAB_PARALLEL)])
def test_hf_decoder_in_the_loop_trains_like_the_reference(family, sharded) -> None:
    ref = run(0, 2, dataclasses.replace(BASE, family=family.split(":")[0], mode="reference"))
    for out in sharded:
        res = out[family]
        assert len(res["losses"]) == 3 and len(res["eval_losses"]) == 1
        torch.testing.assert_close(res["losses"], ref["losses"], rtol=0, atol=1e-6)
        assert set(res["params"]) == set(ref["params"]), family
        for name, value in ref["params"].items():
            torch.testing.assert_close(res["params"][name], value, rtol=0, atol=1e-6)
    # the update moved the weights: the comparison is not between two initial states
    first = run(
        0, 2, dataclasses.replace(BASE, family=family.split(":")[0], mode="reference", steps=0)
    )
    assert any(not torch.equal(first["params"][n], v) for n, v in ref["params"].items())


@pytest.mark.skipif("qwen2" not in FAMILIES, reason="transformers has no Qwen2")
def test_vocab_parallel_embedding_refuses_tied_embeddings(sharded) -> None:
    for out in sharded:
        msg = out["qwen2:vocab_parallel"]
        assert "lm.model.embed_tokens.weight is tied to ['lm.lm_head.weight']" in msg, msg
