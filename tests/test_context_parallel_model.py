"""GPTModel under context parallelism: each CP rank runs its two load-balanced chunks (RoPE at their global
positions, ring attention over the CP group), and the loss normalization plus the DP x CP grad average give
the gradients of the single-process model built from scratch on the whole sequence (fp32)."""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel import collectives as C
from megafp8.parallel.context_parallel import split_for_context_parallel
from megafp8.parallel.cross_entropy import loss_normalizer
from megafp8.parallel.parallel_state import ParallelState


def _config(recompute: str | None) -> ModelConfig:
    # GQA (8 heads in 4 groups), 2 layers, 24 tokens: chunks of 3 (CP 4) or 6 (CP 2) tokens, odd lengths included.
    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, num_query_groups=4,
                       seq_length=24, vocab_size=100, make_vocab_size_divisible_by=8, recompute_granularity=recompute)


def _batch(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    mask = (torch.rand(2, cfg.seq_length, generator=g) > 0.2).float()  # uneven tokens per chunk
    return ids[:, :-1], ids[:, 1:], mask


def _body(rank: int, world_size: int, recompute: str | None) -> None:
    cfg = _config(recompute)
    ids, labels, mask = _batch(cfg)
    reference = GPTModel(cfg, ParallelState().init_process_groups())
    ref_loss = (reference(ids, labels) * mask).sum() / mask.sum()
    ref_loss.backward()

    ps = ParallelState(world_size=world_size, context_parallel_size=world_size).init_process_groups()
    model = GPTModel(cfg, ps)
    local = [split_for_context_parallel(t, 1, ps.cp_rank, ps.cp_size) for t in (ids, labels, mask)]
    loss = (model(local[0], local[1]) * local[2]).sum() / loss_normalizer(local[2], ps.cp_group)
    loss.backward()
    # The DP x CP average the grad buffer does (DP = 1 here), and the mean over CP of the logged loss.
    mean_loss = C.all_reduce(loss.detach().reshape(1), ps.dp_group, "dp_grad_reduce") / ps.dp_group.size
    torch.testing.assert_close(mean_loss[0], ref_loss.detach(), rtol=1e-6, atol=0)
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = C.all_reduce(p.grad.clone(), ps.dp_group, "dp_grad_reduce") / ps.dp_group.size
        expected = ref_grads[name].grad
        err = (grad - expected).norm() / expected.norm()
        assert err < 1e-5, (name, float(err))


@pytest.mark.parametrize("cp, recompute", [(2, None), (4, "selective")])
def test_context_parallel_grads_equal_the_single_process_model(cp, recompute):
    run_distributed(_body, cp, args=(recompute,))
