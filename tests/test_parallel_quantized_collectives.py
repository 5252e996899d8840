"""QuantizedTensors over gloo: a row all-gather and an uneven all-to-all move each tensor's payload and scales as bytes
in one collective, for every layout, and come back bit-identical to quantizing the rows on one rank; counters charge
the true bytes (a packed 4-bit payload half a byte per element)."""
import pytest
import torch

from distributed_testing import run_distributed
from megafp8.parallel.collectives import GroupHandle
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.quantized_collectives import all_gather_rows_async, all_to_all_rows_async
from megafp8_kernels import Granularity, QuantizedTensor, quantize, wire_bytes

LAYOUTS = [Granularity.ROWWISE, Granularity.BLOCK_1X128, Granularity.TENSORWISE]


def _rows(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(10 + rank)) * (rank + 1)


def _quantized(x: torch.Tensor, gran: Granularity, scale=None) -> QuantizedTensor:
    return QuantizedTensor.from_quantized(quantize(x, torch.float8_e4m3fn, gran, scale=scale), gran)


def _assert_same(got: QuantizedTensor, want: QuantizedTensor) -> None:
    assert got.shape == want.shape and got.layout == want.layout and got.format == want.format
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale_inv.reshape(-1), want.scale_inv.reshape(-1))
    assert got.scale_inv.stride() == want.scale_inv.stride()  # the quantizer's memory layout, restored


def _body(rank: int, world_size: int) -> None:
    ps = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size).init_process_groups()
    tp, counters = ps.tp_group, ps.comm
    one_scale = torch.tensor(3.0)
    for gran in LAYOUTS:
        scale = one_scale if gran is Granularity.TENSORWISE else None  # one scale: agreed by every rank
        everyone = [_rows(r, 4) for r in range(world_size)]
        local = _quantized(everyone[rank], gran, scale)
        counters.reset()
        gathered = all_gather_rows_async(local, tp, "tp_sp_allgather").wait()
        expected = _quantized(torch.cat(everyone), gran, scale)
        assert torch.equal(gathered.data.view(torch.uint8), expected.data.view(torch.uint8))
        sent = local.data.numel() + (0 if gran is Granularity.TENSORWISE else local.scale_inv.numel() * 4)
        assert counters["tp_sp_allgather"] == sent * (world_size - 1)

        # Uneven all-to-all: rank r sends (r + 1) * (j + 1) rows to member j.
        splits = [[(r + 1) * (j + 1) for j in range(world_size)] for r in range(world_size)]
        sources = [_rows(100 + r, sum(splits[r])) for r in range(world_size)]
        mine = _quantized(sources[rank], gran, scale)
        counters.reset()
        received = all_to_all_rows_async(mine, splits[rank], [splits[r][rank] for r in range(world_size)], tp,
                                         "tp_sp_allgather").wait()
        pieces = []
        for r in range(world_size):
            start = sum(splits[r][:rank])
            pieces.append(sources[r][start:start + splits[r][rank]])
        _assert_same(received, _quantized(torch.cat(pieces), gran, scale))
        row_bytes = 256 + (0 if gran is Granularity.TENSORWISE else local.scale_inv.shape[1] * 4)
        assert counters["tp_sp_allgather"] == row_bytes * sum(n for j, n in enumerate(splits[rank]) if j != rank)


@pytest.mark.distributed
def test_quantized_tensors_travel_as_bytes_with_their_scales():
    run_distributed(_body, world_size=2)


def test_a_rowwise_group_of_several_rows_cannot_travel_by_rows():
    q = _quantized(torch.randn(256, 256), Granularity.BLOCK_128X128)
    with pytest.raises(ValueError, match="groups several rows"):
        all_to_all_rows_async(q, [256], [256], GroupHandle.solo(), "tp_sp_allgather")


def test_byte_sizes_are_true_for_packed_formats_and_one_byte_dtypes_travel_as_uint8():
    from dataclasses import replace

    from megafp8_kernels import E4M3

    fp4 = replace(E4M3, bits=4, name="toy_fp4")  # a packed format: two elements per byte
    q = QuantizedTensor((8, 64), fp4, Granularity.ROWWISE, torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 1))
    assert q.payload_nbytes(8 * 64) == 256 and q.nbytes == 8 * 32 + 8 * 4 and q.logical_numel == 512
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        assert wire_bytes(torch.zeros(4, dtype=dtype)).dtype == torch.uint8
    assert wire_bytes(torch.zeros(4, dtype=torch.int8)).dtype == torch.int8
    assert wire_bytes(torch.zeros(4)).dtype == torch.float32
