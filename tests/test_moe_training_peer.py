"""A training peer end to end: a random HF Mixtral, imported with the converter and trained by `megafp8.pretrain` at
EP2 x DP2 (experts split over the two data-parallel ranks, FP8-free fp32), against the HF model itself trained by
`torch.optim.AdamW` on the same samples with Megatron's objective written here (the token-mean cross entropy plus
the coefficient times each layer's Switch balancing loss per micro-batch): per-step losses and balancing losses agree
to 1e-5."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from data_fixtures import REPO_ROOT  # noqa: E402
from megafp8.parallel.parallel_state import ParallelState  # noqa: E402
from megafp8.training.arguments import parse_args  # noqa: E402
from megafp8.training.data_setup import batches, build_datasets  # noqa: E402
from test_convert_hf_moe import VOCAB, _import, tiny_hf_moe  # noqa: E402

SEQ, STEPS, LR, AUX = 16, 3, 1e-3, 1e-2
RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),  # + its EOD = VOCAB
       "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(STEPS), "--lr", str(LR),
       "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0", "--adam-beta2", "0.999",
       "--moe-aux-loss-coeff", str(AUX), "--eval-iters", "0", "--log-interval", "1",
       "--make-vocab-size-divisible-by", "16"]


def _switch_loss(router_logits: torch.Tensor, topk: int) -> torch.Tensor:
    """E * sum_e (tokens choosing e / (k T)) * mean_t p_te, over one micro-batch's tokens."""
    experts = router_logits.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)
    chosen = F.one_hot(torch.topk(router_logits, topk, dim=-1).indices, experts).sum(1).float()
    return experts * ((chosen.mean(0) / topk) * probs.mean(0)).sum()


@pytest.mark.distributed
def test_hf_mixtral_with_adamw_reproduces_megafp8_ep2_dp2_training(tmp_path):
    peer = tiny_hf_moe(tmp_path / "hf", "mixtral").train()
    printed = _import(tmp_path)
    flags = re.search(r"--finetune (.*?) --tokenizer-", printed).group(1).split()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "megafp8.pretrain", "--load", str(tmp_path / "m8"), "--finetune", *flags, *RUN,
               "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--log-dir", str(tmp_path / "log"),
               "--distributed-timeout-minutes", "2"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    records = [r for r in map(json.loads, (tmp_path / "log" / "metrics.jsonl").read_text().splitlines())
               if "lm_loss" in r]

    # The same samples, read by the training entry's own data pipeline in one process (the DP split of a global
    # batch does not change a token-mean loss, nor a mean of per-sample balancing losses).
    args = parse_args([*flags, *RUN])
    samples = batches(build_datasets(args)[0], 0, args, ParallelState().init_process_groups())
    topk, layers = peer.config.num_experts_per_tok, peer.config.num_hidden_layers
    optimizer = torch.optim.AdamW(peer.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for step, record in enumerate(records):
        tokens = torch.cat([next(samples) for _ in range(4)])
        out = peer(input_ids=tokens[:, :-1], output_router_logits=True)
        lm_loss = F.cross_entropy(out.logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        # HF's router logits are [batch x seq, experts] per layer, sample-major: one micro-batch = one sample here.
        balance = torch.stack([_switch_loss(logits.view(4, SEQ, -1)[b], topk) for logits in out.router_logits
                               for b in range(4)]).view(layers, 4)
        assert abs(record["lm_loss"] - lm_loss.item()) <= 1e-5 * lm_loss.item(), (step, record, lm_loss)
        assert abs(record["moe_aux_loss"] - balance.mean().item()) <= 1e-5 * balance.mean().item(), step
        optimizer.zero_grad()
        (lm_loss + AUX * balance.sum(0).mean()).backward()
        optimizer.step()
    assert len(records) == STEPS and records[-1]["lm_loss"] < records[0]["lm_loss"]
