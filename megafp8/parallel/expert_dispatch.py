"""Expert parallelism's token exchange: each (token, expert) row travels to the rank holding its expert and its output
comes back (Megatron-Core's alltoall dispatcher), as autograd functions whose backward is the reverse exchange; or
every rank gathers every EP rank's tokens and routing, runs its experts on the choices that reached them, and the
per-token sums are reduce-scattered back (Megatron-Core's allgather dispatcher, ``AllGatherExchange``).

Rows leave sorted by global expert (megafp8.model.moe.dispatch_order), so the rows for EP rank r are one contiguous
run: experts ``[r E/EP, (r+1) E/EP)``. The receiver gets them grouped by source rank and regroups them by local
expert (a permutation built from the exchanged counts), runs its experts, and undoes both on the way back. The
counts travel first (a small all-to-all of ``[EP, E/EP]`` integers, read on the host: the row exchange needs its
split sizes there, as in Megatron). Rows are counted as ``ep_alltoall``; the counts are not (like the loss
normalizer's token count).

FP8 dispatch (``fp8=True``, when the experts run an 8- or 4-bit recipe): the rows travel as E4M3 bytes with one
power-of-two fp32 scale per 1x128 block of each row (DeepSeek-V3's dispatch format), packed into one byte message
per destination: ``h + 4 ceil(h/128)`` bytes a row, 0.516x BF16's ``2h`` (one 4-byte scale per 128 values). The
receiver dequantizes them for the expert's FC1, whose own input cast then re-quantizes them: losslessly under
``--fp8-recipe blockwise`` with power-of-two scales (the same 1x128 blocks: every value is already on the grid),
a second rounding onto the recipe's grid otherwise. The backward (the rows' gradient) and the combine return in
high precision (BF16 on GPUs), DeepSeek's choice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8_kernels import Granularity, quantize

from megafp8.parallel import collectives as C
from megafp8.parallel.collectives import GroupHandle


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], ep: GroupHandle):
        ctx.splits, ctx.ep = (output_splits, input_splits), ep
        return C.all_to_all_uneven(rows, output_splits, input_splits, ep, "ep_alltoall")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return C.all_to_all_uneven(grad.contiguous(), input_splits, output_splits, ctx.ep, "ep_alltoall"), \
            None, None, None


BLOCK = 128  # elements per dispatch scale (DeepSeek-V3's 1x128 activation blocks)


def _pack_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[n, h]`` -> ``[n, h + 4 ceil(h / 128)]`` uint8: each row's E4M3 bytes, then its fp32 block scales' bytes."""
    blocks = -(-rows.shape[1] // BLOCK)
    if rows.shape[0] == 0:  # the cast refuses an empty tensor; nothing to send
        return rows.new_empty((0, rows.shape[1] + 4 * blocks), dtype=torch.uint8)
    q = quantize(rows.detach().contiguous(), torch.float8_e4m3fn, Granularity.BLOCK_1X128, power_of_2_scale=True)
    scales = q.scale_inv.float().clone(memory_format=torch.contiguous_format)  # row-major even for one row
    return torch.cat([q.data.view(torch.uint8), scales.view(torch.uint8)], dim=1)


def _unpack_fp8_rows(packed: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The rows' values (E4M3 value x its block's scale) in ``dtype``."""
    data = packed[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    scale_inv = packed[:, hidden:].contiguous().view(torch.float32)
    return (data.float() * scale_inv.repeat_interleave(BLOCK, dim=1)[:, :hidden]).to(dtype)


class _Fp8AllToAll(torch.autograd.Function):
    """The dispatch in FP8 bytes; its backward sends the rows' gradient back in high precision (straight through
    the cast, as every FP8 cast of megafp8's linears)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], ep: GroupHandle):
        ctx.splits, ctx.ep = (output_splits, input_splits), ep
        packed = C.all_to_all_uneven(_pack_fp8_rows(rows), output_splits, input_splits, ep, "ep_alltoall")
        return _unpack_fp8_rows(packed, rows.shape[1], rows.dtype)

    backward = _AllToAll.backward


class ExpertExchange:
    """One micro-batch's exchange over the EP group: ``dispatch`` sends this rank's rows (sorted by global expert, with
    ``counts`` per global expert) and returns the rows of this rank's experts grouped by local expert, with their
    counts; ``combine`` sends those rows' outputs back and returns them in the original order."""

    def __init__(self, counts: torch.Tensor, ep: GroupHandle) -> None:
        self.ep = ep
        local = counts.numel() // ep.size
        send = counts.view(ep.size, local)  # [destination rank, its local expert]
        recv = torch.empty_like(send)
        if ep.size > 1:
            dist.all_to_all_single(recv, send.contiguous(), group=ep.group)
        else:
            recv.copy_(send)
        send_host, recv_host = send.tolist(), recv.tolist()  # [rank][local expert], one read each
        self.input_splits = [sum(row) for row in send_host]
        self.output_splits = [sum(row) for row in recv_host]
        self.local_counts = recv.sum(0)
        # Received rows come [source][local expert]; the experts want [local expert][source]: segment (e, src) starts
        # at its source-major offset and the segments are laid out expert-major.
        source_major = recv.flatten()
        segment_start = (torch.cumsum(source_major, 0) - source_major).view(ep.size, local).t().flatten()
        segment_count = recv.t().flatten()
        within = torch.arange(int(segment_count.sum()), device=counts.device) - torch.repeat_interleave(
            torch.cumsum(segment_count, 0) - segment_count, segment_count)
        self.by_expert = torch.repeat_interleave(segment_start, segment_count) + within
        self.by_source = torch.empty_like(self.by_expert)
        self.by_source[self.by_expert] = torch.arange(self.by_expert.numel(), device=counts.device)

    def dispatch(self, rows: torch.Tensor, fp8: bool = False) -> torch.Tensor:
        exchange = _Fp8AllToAll if fp8 else _AllToAll
        received = exchange.apply(rows, self.output_splits, self.input_splits, self.ep)
        return received[self.by_expert]

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(outputs[self.by_source], self.input_splits, self.output_splits, self.ep)


class _GatherTokens(torch.autograd.Function):
    """Every EP rank's ``[T, ...]`` tokens, concatenated (equal T on every rank); FP8 bytes + 1x128 scales with
    ``fp8``. Backward: each token's gradient summed over the ranks whose experts it reached (a reduce-scatter, in high
    precision)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, ep: GroupHandle, fp8: bool):
        ctx.ep = ep
        if not fp8:
            return C.all_gather(tokens.contiguous(), ep, "ep_allgather")
        gathered = C.all_gather(_pack_fp8_rows(tokens), ep, "ep_allgather")
        return _unpack_fp8_rows(gathered, tokens.shape[1], tokens.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return C.reduce_scatter(grad.contiguous(), ctx.ep, "ep_allgather"), None, None


class _ReduceScatterTokens(torch.autograd.Function):
    """The per-token partial outputs of every rank's experts, summed over EP; this rank's tokens kept. Backward: the
    tokens' output gradient gathered to every rank."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, ep: GroupHandle):
        ctx.ep = ep
        return C.reduce_scatter(partial.contiguous(), ep, "ep_allgather")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return C.all_gather(grad.contiguous(), ctx.ep, "ep_allgather"), None


class AllGatherExchange:
    """Megatron-Core's allgather dispatcher for one micro-batch: ``gather`` brings every EP rank's tokens ``[T, h]``,
    routing weights ``[T, k]`` and kept choices to every rank and returns the rows of this rank's experts (grouped by
    local expert, each expert's rows in source-rank then token order, as ``ExpertExchange`` delivers them), with their
    counts; ``combine`` weights those rows' outputs, sums each token's share here and reduce-scatters the sums: this
    rank's ``[T, h]``. Fixed-size collectives and no counts exchanged first (no host read to size them), at the cost of
    every rank receiving every token: Megatron's choice for small EP."""

    def __init__(self, ep: GroupHandle, first_expert: int, local_experts: int) -> None:
        self.ep, self.first, self.local = ep, first_expert, local_experts

    def gather(self, tokens: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, kept: torch.Tensor,
               fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``experts``/``probs`` ``[T, k]``, ``kept`` ``[T k]`` bool (capacity drops): (rows, counts per local
        expert)."""
        self.shape = (tokens.shape[0], experts.shape[1], tokens.shape[1])
        all_tokens = _GatherTokens.apply(tokens, self.ep, fp8)
        self.all_probs = _GatherTokens.apply(probs, self.ep, False).reshape(-1)
        routing = torch.cat([experts.reshape(-1).to(torch.int64), kept.to(torch.int64)])
        routing = C.all_gather(routing.view(2, -1).t().contiguous(), self.ep, "ep_allgather")  # [EP T k, 2]
        all_experts, all_kept = routing[:, 0], routing[:, 1].bool()
        mine = all_kept & (all_experts >= self.first) & (all_experts < self.first + self.local)
        choices = mine.nonzero().squeeze(1)  # ascending: source, token, choice
        self.choices = choices[torch.argsort(all_experts[choices], stable=True)]  # grouped by expert, order kept
        counts = torch.bincount(all_experts[self.choices] - self.first, minlength=self.local)
        return all_tokens[self.choices // self.shape[1]], counts

    def combine(self, outputs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's ``[T, h]``: the weighted outputs of every rank's experts for its tokens, in ``dtype`` (each
        rank sums its experts' share of a token in fp32 in choice order; the reduce-scatter adds the ranks')."""
        tokens, k, hidden = self.shape
        weighted = outputs.float() * self.all_probs[self.choices].unsqueeze(-1)
        slots = weighted.new_zeros(self.ep.size * tokens * k, hidden).index_copy_(0, self.choices, weighted)
        return _ReduceScatterTokens.apply(slots.view(-1, k, hidden).sum(1).to(dtype), self.ep)
