"""Cross-entropy over vocab-sharded logits: no rank ever holds the full ``[..., vocab]`` logits, nor an
fp32 copy of its own ``[tokens, vocab/TP]`` shard.

Per token, with the rank-local logits ``z_r`` (computed in fp32):

    m_r = max z_r,  S_r = sum exp(z_r - m_r)      local, one pass over row chunks of the logits
    m = allreduce_max(m_r)                        stability shift, identical on every rank
    p = allreduce_sum(z_r[target] - m if owned)   the target logit, found on exactly one rank
    S = allreduce_sum(S_r * exp(m_r - m))         the rank's sum moved to the common shift
    loss = log S - p                              = -log softmax(z)[target]
    dloss/dz_r = softmax_r - onehot_r(target)     local: softmax_r = exp(z_r - m) / S

``p`` and ``S`` travel in one all-reduce, so a call costs two small collectives ([tokens] floats each)
instead of gathering ``[tokens, vocab]``, however many chunks there are. Columns at or past ``vocab_size``
(vocab padding) are excluded (zero grad), so the loss equals ``F.cross_entropy`` on the unpadded logits.

Memory: the logits are read in chunks of whole rows whose fp32 copy is at most ``CHUNK_BYTES``; forward
keeps only ``m`` and ``S`` per token (plus a reference to the logits, which autograd holds anyway), and
backward writes the gradient in the logits' dtype chunk by chunk. At vocab 128k in bf16 that is at most
64 MiB of fp32 at a time, where an fp32 copy of the logits (0.5 GB per 1k tokens) used to be kept from
forward to backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle

# Largest fp32 temporary of one call: big enough that each chunk's few kernels stay bandwidth-bound
# (64 MiB is ~20 us of HBM traffic on a Hopper GPU), small next to the activations of a micro-batch.
CHUNK_BYTES = 64 * 2 ** 20


def _row_chunks(num_rows: int, num_columns: int) -> list[slice]:
    rows = max(1, CHUNK_BYTES // (4 * max(num_columns, 1)))
    return [slice(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_parallel: torch.Tensor, target: torch.Tensor, tp: GroupHandle,
                vocab_size: int | None) -> torch.Tensor:
        partition = logits_parallel.shape[-1]
        vocab_start = tp.rank * partition
        # Columns of real tokens on this rank (the rest is vocab padding; possibly every column).
        valid = partition if vocab_size is None else min(max(vocab_size - vocab_start, 0), partition)
        logits = logits_parallel.reshape(-1, partition)  # a view for the contiguous logits of the model
        target = target.reshape(-1)

        local_max = torch.full((logits.shape[0],), float("-inf"), dtype=torch.float32, device=logits.device)
        local_sum = torch.zeros_like(local_max)
        if valid > 0:
            for rows in _row_chunks(logits.shape[0], valid):
                chunk = logits[rows, :valid].to(torch.float32, copy=True)  # never the caller's tensor
                chunk_max = chunk.amax(dim=-1)
                local_max[rows] = chunk_max
                local_sum[rows] = chunk.sub_(chunk_max.unsqueeze(-1)).exp_().sum(dim=-1)
        logits_max = C.all_reduce(local_max.clone(), tp, "tp_allreduce", op=dist.ReduceOp.MAX)

        not_owned = (target < vocab_start) | (target >= vocab_start + valid)
        local_target = (target - vocab_start).masked_fill(not_owned, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float().sub_(logits_max)
        # exp(-inf - m) = 0 takes a rank without real columns out of the sum.
        predicted_and_sum = torch.stack([predicted.masked_fill_(not_owned, 0.0),
                                         local_sum.mul_(local_max.sub_(logits_max).exp_())])
        C.all_reduce(predicted_and_sum, tp, "tp_allreduce")
        predicted, sum_exp = predicted_and_sum.unbind(0)

        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, not_owned)
        ctx.valid, ctx.logits_shape = valid, logits_parallel.shape
        return (torch.log(sum_exp) - predicted).view(logits_parallel.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, logits_max, sum_exp, local_target, not_owned = ctx.saved_tensors
        valid = ctx.valid
        grad_loss = grad_loss.reshape(-1)
        grad = torch.empty_like(logits)
        grad[:, valid:].zero_()  # vocab padding (not `= 0`: that lifts a host scalar to the device)
        # -1 at the target column of the rows whose target this rank owns, as in softmax - onehot.
        target_step = (~not_owned).to(torch.float32).neg_().unsqueeze(-1)
        if valid > 0:
            for rows in _row_chunks(logits.shape[0], valid):
                softmax = logits[rows, :valid].to(torch.float32, copy=True)
                softmax.sub_(logits_max[rows].unsqueeze(-1)).exp_().div_(sum_exp[rows].unsqueeze(-1))
                softmax.scatter_add_(-1, local_target[rows].unsqueeze(-1), target_step[rows])
                grad[rows, :valid] = softmax.mul_(grad_loss[rows].unsqueeze(-1))
        return grad.view(ctx.logits_shape), None, None, None


def vocab_parallel_cross_entropy(logits_parallel: torch.Tensor, target: torch.Tensor, tp: GroupHandle,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) from this rank's logits ``[..., V/TP]`` and targets ``[...]``.

    ``vocab_size``: the real vocab; padded columns beyond it are ignored. Targets must be valid ids
    (mask ignored positions with a loss mask afterwards, as the training loop does).
    """
    return _VocabParallelCrossEntropy.apply(logits_parallel, target, tp, vocab_size)


def loss_normalizer(loss_mask: torch.Tensor, cp: GroupHandle | None = None) -> torch.Tensor:
    """What a rank divides its summed token losses by so that the DP x CP gradient average is the token mean.

    Without context parallelism: the rank's unmasked tokens (at least 1). With it each rank holds 2 of the
    sequence's 2 x CP chunks, so the tokens of the whole sequences (all-reduced over the CP group) divided
    by CP: each rank's loss is CP x its share of the sequence mean, their mean over CP the sequence mean,
    and the DP x CP grad average (``dp_group``) exactly CP=1's DP average. Logging-sized: not byte-counted."""
    tokens = loss_mask.sum()
    if cp is None or cp.size == 1:
        return tokens.clamp(min=1.0)
    tokens = tokens.detach().float().reshape(1).clone()
    dist.all_reduce(tokens, group=cp.group)
    return (tokens.clamp(min=1.0) / cp.size).reshape(())
