"""Byte-true low-precision DDP buffers: with a fake 4-bit ElementFormat the FP8 buckets' fp8_data holds half a byte per
element, every parameter's and shard's bytes start where bits x elements / 8 says, and the publication's byte offsets
(slab destinations, the fused cast's table) follow; with the real 8-bit formats bytes equal elements, as before."""
import pytest
import torch

from optim_testing import build, make_ddp, tiny_config
from megafp8.fp8 import Fp8Recipe
from megafp8.optim import fp8_publication, fused_fp8_publication
from megafp8.optim.state_codec import GROUP
from megafp8.optim.storage_layout import StorageLayout
from megafp8.optim.storage_slabs import STEP_SLAB
from megafp8.parallel import grad_buffer
from megafp8.parallel.parallel_state import ParallelState
from megafp8_kernels import ElementFormat

FAKE_FP4 = ElementFormat(torch.float8_e4m3fn, 6.0, 1, 0, bits=4, name="fake_fp4")


def _released_ddp():
    ps = ParallelState().init_process_groups()
    model = build(tiny_config(hidden_size=64, ffn_hidden_size=96), ps, fp8_recipe=Fp8Recipe.tensorwise())
    ddp = make_ddp(model, ps, use_distributed_optimizer=True, fp8_param_gather=True, bucket_size=5000)
    ddp.release_fp8_param_storage()
    return ddp


def _byte_offset(view: torch.Tensor, base: torch.Tensor) -> int:
    return view.data_ptr() - base.data_ptr()


def _publication_runs(ddp):
    layout = StorageLayout(ddp, weight_decay=0.0, decoupled_lr_params=(), slab_size=STEP_SLAB, device="cpu")
    frags = sorted((f for f in layout.fragments if f.param in ddp.fp8_params), key=lambda f: f.storage_lo)
    return frags, fp8_publication._contiguous_runs(frags)


@pytest.mark.parametrize("bits", [8, 4])
def test_fp8_buffers_are_sized_and_sliced_in_bytes(monkeypatch, bits):
    if bits != 8:
        monkeypatch.setattr(grad_buffer, "element_format", lambda dtype: FAKE_FP4)
    ddp = _released_ddp()
    fp8_buckets = [b for b in ddp.buckets if b.fp8]
    assert len(fp8_buckets) > 1  # several buckets: offsets inside each and across them
    for bucket in fp8_buckets:
        assert bucket.fp8_bits == bits and bucket.fp8_data.dtype == torch.uint8
        assert bucket.fp8_data.numel() == bucket.numel * bits // 8
        for p in bucket.params:
            start, end = bucket.ranges[p]
            piece = bucket.fp8_slice(start, end)
            assert _byte_offset(piece, bucket.fp8_data) == start * bits // 8
            assert piece.numel() == -(-p.numel() * bits // 8)
        data, lo, hi = ddp._gather_source(bucket)
        assert data is bucket.fp8_data and (lo, hi) == (0, bucket.numel * bits // 8)
    assert all(b.fp8_bits == 8 and b.fp8_data is None for b in ddp.buckets if not b.fp8)

    frags, runs = _publication_runs(ddp)
    assert frags and runs
    for g0, n, bucket, pos in runs:
        first = next(f for f in frags if f.storage_lo // GROUP == g0)
        assert pos == first.bucket_lo * bits // 8
    group_bytes = GROUP * bits // 8
    slab_dests = [d for slab in fp8_publication._make_slabs(runs, "cpu") for d in slab.dests]
    assert [d.numel() for d in slab_dests] == [n * group_bytes for _g0, n, _b, _pos in runs]
    assert [_byte_offset(d, b.fp8_data) for d, (_g0, _n, b, _pos) in zip(slab_dests, runs)] == [r[3] for r in runs]
    tables = fp8_publication._fused_tables(runs, [torch.float8_e4m3fn], "cpu")
    expected = torch.cat([torch.arange(n) * group_bytes + pos for _g0, n, _bucket, pos in runs])
    assert torch.equal(tables.dest_offset, expected)


def test_packed_formats_are_refused_by_the_one_byte_casts(monkeypatch):
    monkeypatch.setattr(fused_fp8_publication, "element_format", lambda dtype: FAKE_FP4)
    with pytest.raises(ValueError, match="one byte per element"):
        fused_fp8_publication.format_ids([torch.float8_e4m3fn])
