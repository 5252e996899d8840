"""Shared pieces of the optimizer tests: a tiny GPT, deterministic batches, the torch.optim.AdamW reference."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.model import GPTModel, ModelConfig
from megafp8.optim import DistributedOptimizer
from megafp8.parallel.data_parallel import DDPConfig, DistributedDataParallel
from megafp8.parallel.parallel_state import ParallelState

MICRO_BATCH = 2
MICRO_BATCHES = 2


def tiny_config(**kw) -> ModelConfig:
    defaults = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=8,
                    vocab_size=50, make_vocab_size_divisible_by=8)
    return ModelConfig(**{**defaults, **kw})


def build(cfg: ModelConfig, ps: ParallelState, seed: int = 0, **model_kw) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(cfg, ps, **model_kw)


def global_batch(cfg: ModelConfig, step: int, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[sequences, seq] ids and labels (labels = ids shifted: a learnable task)."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, cfg.vocab_size, (sequences, cfg.seq_length + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def local_micro_batches(cfg, step: int, dp: int, dp_rank: int, sequences: int | None = None):
    """This DP rank's micro-batches of the step's global batch (default: MICRO_BATCHES per rank)."""
    sequences = sequences or dp * MICRO_BATCHES * MICRO_BATCH
    ids, labels = global_batch(cfg, step, sequences)
    per_rank = sequences // dp
    ids, labels = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank], labels[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return list(zip(ids.split(MICRO_BATCH), labels.split(MICRO_BATCH)))


def train_step(ddp: DistributedDataParallel, opt: DistributedOptimizer, cfg, step: int, lr: float,
               sequences: int | None = None, before_step=None):
    """One iteration: micro-batches (all but the last under no_sync), ``before_step()`` (e.g. the
    delayed-scaling update), then the optimizer step."""
    opt.zero_grad()
    batches = local_micro_batches(cfg, step, ddp.dp.size, ddp.dp.rank, sequences)
    losses = []
    for i, (ids, labels) in enumerate(batches):
        sync = ddp.no_sync() if i < len(batches) - 1 else _nullcontext()
        with sync:
            loss = ddp(ids, labels).mean() / len(batches)
            loss.backward()
        losses.append(loss.detach())
    if before_step is not None:
        before_step()
    return opt.step(lr), float(sum(losses))


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def reference_adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.999), eps=1e-8):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)


def reference_step(model, opt, cfg, step: int, dp: int, clip_grad: float = 0.0) -> None:
    opt.zero_grad()
    ids, labels = global_batch(cfg, step, dp * MICRO_BATCHES * MICRO_BATCH)
    # The DP run's loss: mean over ranks of (sum over micro-batches of the micro-batch mean / count).
    for mb_ids, mb_labels in zip(ids.split(MICRO_BATCH), labels.split(MICRO_BATCH)):
        (model(mb_ids, mb_labels).mean() / (MICRO_BATCHES * dp)).backward()
    if clip_grad:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    opt.step()


def make_ddp(model, ps, **config_kw) -> DistributedDataParallel:
    return DistributedDataParallel(model, ps, DDPConfig(**config_kw))


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def full_masters(opt) -> dict[str, torch.Tensor]:
    """Every parameter's master weight (fp32), assembled from all DP ranks' optimizer state dicts."""
    mine = {name: (e["start"], e["numel"], e["master.values"].float() / e["master_scale"])
            for name, e in opt.state_dict()["fragments"].items()}
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, mine)
    full = {}
    for shard in shards:
        for name, (start, numel, values) in shard.items():
            full.setdefault(name, torch.zeros(numel))[start:start + values.numel()] = values
    return full


def assert_forward_equals_one_rank_model(model, ddp, cfg, ps, full: dict[str, torch.Tensor], **model_kw) -> None:
    """The forward on the weights the layers were handed equals a one-rank model that holds the full master weights
    (``full_masters``) and quantizes them itself, bit for bit."""
    names = ddp.param_names
    reference = build(cfg, ParallelState().init_process_groups(), **model_kw)
    state = model.state_dict()
    state.update({names[p]: full[names[p]].view(p.shape) for p in ddp.fp8_params})
    reference.load_state_dict(state)
    ids, labels = local_micro_batches(cfg, 99, ps.dp_group.size, ps.dp_group.rank)[0]
    with torch.no_grad():
        assert torch.equal(model(ids, labels), reference(ids, labels))
