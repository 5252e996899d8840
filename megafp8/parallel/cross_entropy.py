"""Cross-entropy over vocab-sharded logits: no rank ever holds the full ``[..., vocab]`` logits.

Per token, with the rank-local logits ``z_r`` (fp32):

    m = allreduce_max(max z_r)                    stability shift, identical on every rank
    p = allreduce_sum(z_r[target] - m if owned)   the target logit, found on exactly one rank
    S = allreduce_sum(sum exp(z_r - m))
    loss = log S - p                              = -log softmax(z)[target]
    dloss/dz_r = softmax_r - onehot_r(target)     local: softmax_r = exp(z_r - m) / S

``p`` and ``S`` travel in one all-reduce, so a call costs two small collectives ([tokens] floats each)
instead of gathering ``[tokens, vocab]``. Columns at or past ``vocab_size`` (vocab padding) are
excluded (logit -inf, zero grad), so the loss equals ``F.cross_entropy`` on the unpadded logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_parallel: torch.Tensor, target: torch.Tensor, tp: GroupHandle,
                vocab_size: int | None) -> torch.Tensor:
        logits = logits_parallel.to(torch.float32, copy=True)  # shifted in place below; the caller's tensor stays intact
        partition = logits.shape[-1]
        vocab_start = tp.rank * partition
        if vocab_size is not None and vocab_start + partition > vocab_size:
            logits[..., max(vocab_size - vocab_start, 0):] = float("-inf")

        logits_max = logits.max(dim=-1).values
        C.all_reduce(logits_max, tp, "tp_allreduce", op=dist.ReduceOp.MAX)
        logits.sub_(logits_max.unsqueeze(-1))

        not_owned = (target < vocab_start) | (target >= vocab_start + partition)
        local_target = (target - vocab_start).masked_fill(not_owned, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_owned, 0.0)
        exp_logits = logits.exp_()
        predicted_and_sum = torch.stack([predicted, exp_logits.sum(dim=-1)])
        C.all_reduce(predicted_and_sum, tp, "tp_allreduce")
        predicted, sum_exp = predicted_and_sum.unbind(0)

        loss = torch.log(sum_exp) - predicted
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, not_owned)
        ctx.input_dtype = logits_parallel.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, not_owned = ctx.saved_tensors
        grad = softmax  # reused in place: autograd does not need the saved softmax again
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~not_owned).unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_parallel: torch.Tensor, target: torch.Tensor, tp: GroupHandle,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) from this rank's logits ``[..., V/TP]`` and targets ``[...]``.

    ``vocab_size``: the real vocab; padded columns beyond it are ignored. Targets must be valid ids
    (mask ignored positions with a loss mask afterwards, as the training loop does).
    """
    return _VocabParallelCrossEntropy.apply(logits_parallel, target, tp, vocab_size)
