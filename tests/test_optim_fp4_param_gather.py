"""--fp4-param-gather: each DP rank casts its master shard of every NVFP4 layer's weight (16x16 tiles) straight to
packed E2M1 bytes, the tile amaxes are MAX-reduced over DP (so every rank derives the same tensor scale and tile
scales, TransformerEngine's rule), and the bytes are all-gathered. At DP=2 with shards cutting tiles and rows: the
handed-over weight (bytes, E4M3 tile scales, decode scale, and its transposed copy) is bit-identical to
quantize_microscaled of the full master weight on one rank, the forward equals a one-rank model holding the full
master weights bit for bit, the wire bytes equal the analytic count (<= 0.28x a BF16 gather), no high-precision copy
stays resident, and a guard move to MXFP8 hands the weight back to the high-precision gather."""
import pytest
import torch

from distributed_testing import run_distributed
from optim_testing import assert_forward_equals_one_rank_model, build, full_masters, make_ddp, tiny_config, \
    train_step
from megafp8.fp8 import Fp8Recipe
from megafp8.fp8.precision_plan import demote_layer
from megafp8.optim import DistributedOptimizer
from megafp8.optim.fp8_param_cast import num_scale_groups
from megafp8.parallel.parallel_state import ParallelState
from megafp8_kernels.formats import E2M1
from megafp8_kernels.microscaling import quantize_microscaled
from megafp8_kernels.microscaling_reference import NVFP4_16X16

LR, STEPS = 1e-3, 3
NVFP4 = Fp8Recipe.named("nvfp4", fp8_format="e4m3")


def _config():
    # hidden 160 = 10 tiles; the DP=2 shards of the 3000-element buckets cut tiles and rows.
    return tiny_config(num_layers=1, hidden_size=160, ffn_hidden_size=160, num_attention_heads=4, seq_length=16)


def _gather_body(rank, world_size):
    cfg = _config()
    ps = ParallelState(world_size=world_size).init_process_groups()
    n = world_size
    model = build(cfg, ps, fp8_recipe=NVFP4)
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, fp8_param_gather=True, bucket_size=3000)
    opt = DistributedOptimizer(ddp, weight_decay=0.1)
    assert ddp.fp8_params and all(b.fp8_bits == 4 for b in ddp.buckets if b.fp8)
    for step in range(STEPS):
        ps.comm.reset()
        assert not train_step(ddp, opt, cfg, step, LR)[0].skipped
    ddp.finish_param_sync()

    # Wire bytes of the last step's gather: fp32 buckets 4 B/elem, NVFP4 buckets 1/2 B/elem and the tile amaxes'
    # MAX all-reduce (fp32, ring: 2 (n-1)/n of them per rank).
    hp = sum(b.numel * 4 // n * (n - 1) for b in ddp.buckets if not b.fp8)
    fp4_elems = sum(b.numel for b in ddp.buckets if b.fp8)
    tiles = sum(num_scale_groups(tuple(p.shape), NVFP4_16X16) for p in ddp.fp8_params)
    fp4_bytes = fp4_elems // 2 // n * (n - 1) + 2 * 4 * tiles * (n - 1) // n
    assert ps.comm["dp_param_allgather"] == hp + fp4_bytes
    assert fp4_bytes <= 0.28 * (2 * fp4_elems // n * (n - 1))

    full, names = full_masters(opt), ddp.param_names
    for p, info in ddp.fp8_params.items():
        assert p.untyped_storage().nbytes() <= p.element_size(), "no high-precision copy of an FP4 weight"
        expected = quantize_microscaled(full[names[p]].view(p.shape), E2M1, NVFP4_16X16, transpose=True)[0]
        got = info.module.fp8_weight(info.recipe, p)  # with grad enabled: the transposed copy (dgrad's) too
        assert got.layout == NVFP4_16X16 and got.format is E2M1
        for part in ("data", "data_t", "scale_inv", "scale_inv_t", "global_scale_inv", "global_scale_inv_t"):
            a, b = getattr(got, part), getattr(expected, part)
            assert a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), \
                (names[p], part)

    # The forward on the gathered weights equals a one-rank model that quantizes the full master weights itself.
    assert_forward_equals_one_rank_model(model, ddp, cfg, ps, full, fp8_recipe=NVFP4)

    # The guard's first move of an FP4 layer is to MXFP8, whose weights are not gathered as bytes: the weight goes
    # back to a high-precision gather and its layer quantizes it itself; training goes on.
    p, info = next(iter(ddp.fp8_params.items()))
    (change,) = demote_layer(info.module)
    assert change.new.scaling == "mxfp8" and p in ddp.demoted_fp8_params
    for step in range(STEPS, STEPS + 2):
        assert not train_step(ddp, opt, cfg, step, LR)[0].skipped
    ddp.finish_param_sync()
    assert p not in ddp.fp8_params and p in ddp.switched_weights
    full = full_masters(opt)
    assert torch.equal(p.detach().reshape(-1), full[names[p]])


@pytest.mark.distributed
def test_fp4_param_gather_matches_one_rank_quantization():
    run_distributed(_gather_body, world_size=2, timeout_s=600)
