"""The MoE router: fp32 scores, the top-k choice, the load-balancing and z losses, DeepSeek-V3's expert bias.

Tokens are this rank's ``[s_local * b, hidden]`` rows, ``[s, b]`` flattened (token t = position * b + sample). Under
sequence parallelism (TP > 1) and context parallelism a rank holds a slice of each sequence, so the counts the
losses need (tokens per expert, per sequence for ``seq_aux_loss``) are summed over the TP and CP ranks first, and
each rank's loss is its share of the whole sequence's: their sum over TP x CP is the loss of the unsplit batch
(Megatron-Core's rule), so the gradient does not depend on the layout.

The formulas (T tokens, E experts, top-k, p the router's probability of each expert over all E):

- ``aux_loss`` (Switch Transformer, GShard): ``E * sum_e f_e * P_e`` with ``f_e = N_e / (k T)`` the share of the
  k T choices that went to expert e and ``P_e = sum_t p_te / T`` its mean probability; 1 when balanced.
- ``seq_aux_loss`` (DeepSeek-V3 eq. 17-20): the same per sequence (T = the sequence length), averaged over the
  micro-batch's sequences.
- z loss (ST-MoE): ``mean_t logsumexp(logits_t)^2``.

The logged values are these metrics without their coefficients (as Megatron logs them), whatever
``--moe-router-load-balancing-type``: a run without a balancing loss still shows its imbalance.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megafp8.model.config import ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.tensor_parallel import init_method_normal
from megafp8.parallel.random import set_init_method


class TopKRouter(nn.Module):
    """``x [T, h]`` -> ``(top_experts [T, k] int64, top_probs [T, k] fp32, losses)``: every token's k experts and the
    weights of their outputs. ``losses`` holds the differentiable load-balancing and z losses (this rank's shares)
    and their coefficient-free values for the log."""

    def __init__(self, config: ModelConfig, parallel_state: ParallelState) -> None:
        super().__init__()
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.load_balancing_type = config.moe_router_load_balancing_type
        self.aux_loss_coeff, self.z_loss_coeff = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
        # Megatron's router weight, in the model's dtype; every score is computed in fp32 (--moe-router-dtype fp32).
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=config.params_dtype))
        set_init_method(self.weight, init_method_normal(config.init_method_std))
        self.weight.sequence_parallel = parallel_state.sequence_parallel  # each TP rank routes its own tokens
        # DeepSeek-V3's aux-loss-free balancing: added to the scores for the choice only, updated once per step from
        # the tokens each expert received (update_expert_bias), never by autograd; checkpointed as a buffer.
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        self.bias_update_rate = config.moe_router_bias_update_rate
        if self.enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.parallel_state = parallel_state

    def token_split_groups(self) -> list:
        """The groups splitting a sequence over ranks: TP under sequence parallelism, CP."""
        ps = self.parallel_state
        groups = [ps.tp_group] if ps.sequence_parallel and ps.tp_size > 1 else []
        return groups + ([ps.cp_group] if ps.cp_size > 1 else [])

    def _sum_over_sequence_split(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks holding the other slices of the same sequences (logging-sized, not counted)."""
        groups = self.token_split_groups()
        if not groups:
            return t
        t = t.clone()
        for group in groups:
            dist.all_reduce(t, group=group.group)
        return t

    def forward(self, x: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        logits = F.linear(x.float(), self.weight.float())  # [T, E], fp32
        top_experts, top_probs = self.choose(logits)
        scores = (torch.softmax(logits, dim=-1) if self.score_function == "softmax"
                  else _normalized(torch.sigmoid(logits)))  # the probabilities the balancing losses see
        splits = max(1, _group_product(self.token_split_groups()))
        tokens = logits.shape[0] * splits  # the unsplit batch's tokens
        choices = F.one_hot(top_experts, self.num_experts).sum(1).float()  # [T, E]: 1 where t chose e
        if self.load_balancing_type == "seq_aux_loss":
            seq_tokens = tokens // batch_size
            per_seq = choices.detach().view(-1, batch_size, self.num_experts).sum(0)
            per_seq_choices = self._sum_over_sequence_split(per_seq)
            f = per_seq_choices / (self.topk * seq_tokens)  # [b, E]
            p = scores.view(-1, batch_size, self.num_experts).sum(0) / seq_tokens
            balance = self.num_experts * (f * p).sum(-1).mean()
        else:
            f = self._sum_over_sequence_split(choices.detach().sum(0)) / (self.topk * tokens)
            balance = self.num_experts * (f * scores.sum(0) / tokens).sum()
        z = torch.logsumexp(logits, dim=-1).square().sum() / tokens
        losses = {"aux_metric": balance.detach(), "z_metric": z.detach(), "tokens_per_expert": choices.detach().sum(0)}
        differentiable = []
        if self.load_balancing_type != "none" and self.aux_loss_coeff:
            differentiable.append(self.aux_loss_coeff * balance)
        if self.z_loss_coeff:
            differentiable.append(self.z_loss_coeff * z)
        losses["loss"] = sum(differentiable) if differentiable else None
        return top_experts, top_probs, losses

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron-Core's top-k: softmax over the top-k logits (or over all, then the top k: --moe-router-pre-softmax);
        sigmoid scores chosen with the expert bias added and, for k > 1, normalised over the chosen k; the weights
        then times --moe-router-topk-scaling-factor."""
        top_experts, top_probs = self._choose(logits)
        if self.scaling_factor is not None:
            top_probs = top_probs * self.scaling_factor
        return top_experts, top_probs

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.topk
        if self.score_function == "softmax":  # the expert bias is sigmoid's (ModelConfig refuses it here)
            if self.pre_softmax:
                top_probs, top_experts = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
                return top_experts, top_probs
            top_logits, top_experts = torch.topk(logits, k, dim=-1)
            return top_experts, torch.softmax(top_logits, dim=-1)
        scores = torch.sigmoid(logits)
        top_experts, top_probs = _topk(scores, k, self.expert_bias)
        return top_experts, (_normalized(top_probs) if k > 1 else top_probs)

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3: ``bias_e += rate * sign(mean - tokens_e)`` from the step's tokens per expert (all ranks')."""
        tokens = tokens_per_expert.float()
        self.expert_bias.add_(self.bias_update_rate * torch.sign(tokens.mean() - tokens))


def _topk(scores: torch.Tensor, k: int, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best experts by ``scores + bias`` (bias only chooses) and their unbiased scores."""
    if bias is None:
        top_scores, top_experts = torch.topk(scores, k, dim=-1)
        return top_experts, top_scores
    top_experts = torch.topk(scores + bias, k, dim=-1).indices
    return top_experts, scores.gather(-1, top_experts)


def _normalized(scores: torch.Tensor) -> torch.Tensor:
    return scores / (scores.sum(-1, keepdim=True) + 1e-20)


def _group_product(groups: list) -> int:
    size = 1
    for group in groups:
        size *= group.size
    return size
