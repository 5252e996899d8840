"""The fused optimizer kernels a training step launches (megafp8/optim), as kernel_audit.py's offline sm_90a cases.

Each case is (label, kernel name, call): the call runs the kernel's real host launcher on small CPU tensors inside
kernel_audit's CompileRecorder (compile, never launch), with the launch constants a CUDA device gets (gpu_launch_sizes):
the launchers choose their block and rows per program by the tensors' device, and CPU tensors would otherwise compile
the interpreter's 64k-element programs, which no GPU runs.

A new optimizer kernel (e.g. the fused FP8 publication in megafp8/optim/) joins the audit by adding its cases to
OPTIMIZER_CASE_MAKERS below, and its CPU-vs-CUDA launch constants, if any, to GPU_LAUNCH_SIZES.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, Iterator

# (module, constant the launcher uses on a CPU tensor, constant it uses on a CUDA tensor).
GPU_LAUNCH_SIZES = (("megafp8.optim.fused_adamw", "INTERPRETER_BLOCK", "GPU_BLOCK"),
                    ("megafp8.optim.fused_adamw_coded", "INTERPRETER_BLOCK", "GPU_BLOCK"),
                    ("megafp8.optim.fused_adamw_coded", "INTERPRETER_ROWS", "GPU_ROWS"),
                    ("megafp8.optim.fused_fp8_publication", "INTERPRETER_ROWS", "GPU_ROWS"))

# Flat shard sizes, in elements: a multiple of 16 groups of 128 (every integer argument divisible by 16, as in the
# examples' buckets), and one whose group count is odd (a bucket shard of any size: the group counts and offsets the
# coded kernels take are specialized differently, so the first step would compile it otherwise).
ALIGNED_ELEMENTS, ODD_GROUPS_ELEMENTS = 128 * 64, 128 * 37


@contextlib.contextmanager
def gpu_launch_sizes() -> Iterator[None]:
    """Within `with`: the optimizer launchers pick the block sizes they pick for CUDA tensors (and the publication's
    cast the hardware rounding a GPU uses)."""
    saved = []
    try:
        for module_name, cpu_name, gpu_name in GPU_LAUNCH_SIZES:
            module = importlib.import_module(module_name)
            saved.append((module, cpu_name, getattr(module, cpu_name)))
            setattr(module, cpu_name, getattr(module, gpu_name))
        publication = importlib.import_module("megafp8.optim.fused_fp8_publication")
        saved.append((publication, "_software_rounding", publication._software_rounding))
        publication._software_rounding = lambda device: False
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def _step_scalars():
    """The 0-dim device tensors a step passes (clip factor, finite flag, step size, sqrt(1 - beta2^t))."""
    import torch

    return dict(clip=torch.ones(()), finite=torch.ones((), dtype=torch.bool), step_size=torch.full((), -1e-4),
                bias_correction2_sqrt=torch.ones(()))


def fp32_adamw_cases() -> Iterator[tuple[str, str, Callable[[], None]]]:
    """fp32 master + fp32 moments (the default, ZeRO on or off): the grad norm's per-group squares and the update,
    for fp32 grads and bf16 ones (--grad-reduce-in-bf16), with weight decay and clipping (the defaults) and without."""
    import torch

    from megafp8.optim import fused_adamw as F

    n = ALIGNED_ELEMENTS
    for grad_dtype, what in ((torch.float32, "fp32 grads"), (torch.bfloat16, "bf16 grads")):
        grads = torch.zeros(n, dtype=grad_dtype)
        squares = torch.zeros(n // 128, dtype=torch.float64)
        yield what, "_grad_group_squares_kernel", lambda g=grads, s=squares: F.grad_group_squares_triton(g, 0, s, 0, n)
        for decay, clip in ((True, True), (False, False)):
            label = f"{what}{' decay' if decay else ''}{' clip' if clip else ''}"

            def call(g=grads, decay=decay, clip=clip):
                p, m, v = (torch.zeros(n) for _ in range(3))
                s = _step_scalars()
                F.adamw_fp32_triton(g, 0, p, m, v, 0, n, torch.ones(n // 128, dtype=torch.bool) if decay else None,
                                    s["clip"] if clip else None, s["finite"], s["step_size"],
                                    s["bias_correction2_sqrt"], 0.999, 0.9, 0.95, 1e-8)
            yield label, "_adamw_fp32_kernel", call


def coded_adamw_cases() -> Iterator[tuple[str, str, Callable[[], None]]]:
    """The coded presets (--master-weight-dtype fp16 and/or --optimizer-state-dtype bf16|fp8): the update with decay
    and clipping, fp32 grads, at an aligned and an odd group count (the compressed preset, fp16 master + FP8 moments,
    also with bf16 grads), and the fp16 master's publication into bf16 and fp32 weights."""
    import torch

    from megafp8.optim import fused_adamw_coded as FC
    from megafp8.optim.state_codec import PlainCodec, make_state_codec
    from megafp8.optim.storage_update import Fp16Master

    presets = [("fp16", "fp8"), ("fp16", "bf16"), ("fp16", "fp32"), ("fp32", "fp8"), ("fp32", "bf16")]
    for master_dtype, state_dtype in presets:
        compressed = (master_dtype, state_dtype) == ("fp16", "fp8")
        grads_options = [(torch.float32, "")] + ([(torch.bfloat16, " bf16 grads")] if compressed else [])
        sizes = [(ALIGNED_ELEMENTS, "")] + ([(ODD_GROUPS_ELEMENTS, " odd groups")] if compressed else [])
        for grad_dtype, grads_label in grads_options:
            for n, size_label in sizes:
                label = f"{master_dtype} master {state_dtype} moments{grads_label}{size_label}"

                def call(n=n, master_dtype=master_dtype, state_dtype=state_dtype, grad_dtype=grad_dtype):
                    groups = n // 128
                    master = PlainCodec(n, "cpu", torch.float16 if master_dtype == "fp16" else torch.float32)
                    storage = FC.coded_storage(master, make_state_codec(state_dtype, n, "cpu"),
                                               make_state_codec(state_dtype, n, "cpu"))
                    fp16 = (Fp16Master(torch.ones(groups), torch.zeros(groups, dtype=torch.int64),
                                       torch.zeros(groups, dtype=torch.int64), torch.zeros(groups))
                            if master_dtype == "fp16" else None)
                    FC.adamw_coded_triton(torch.zeros(n, dtype=grad_dtype), 0, 0, n, storage,
                                          group_decay=torch.ones(groups, dtype=torch.bool), decay_factor=0.999,
                                          beta1=0.9, beta2=0.95, eps=1e-8, fp16=fp16, **_step_scalars())
                yield label, "_adamw_coded_kernel", call
    for out_dtype, what in ((torch.bfloat16, "into bf16 weights"), (torch.float32, "into fp32 weights")):
        def publish(out_dtype=out_dtype):
            n = ALIGNED_ELEMENTS
            FC.publish_fp16_master_triton(torch.zeros(n, dtype=torch.float16), torch.ones(n // 128), 0,
                                          torch.zeros(n, dtype=out_dtype))
        yield what, "_publish_fp16_master_kernel", publish


def fp8_publication_cases() -> Iterator[tuple[str, str, Callable[[], None]]]:
    """--fp8-param-gather's fused publication (megafp8/optim/fused_fp8_publication.py): the per-group amax from an
    fp32 and an fp16 master, and the cast into E4M3-only, E5M2-only and mixed buckets (hybrid recipes with E5M2
    weights mix them), through one address table."""
    import torch

    from megafp8.optim import fused_fp8_publication as P

    n = ALIGNED_ELEMENTS
    groups = n // 128

    def tables(master_dtype):
        # One tensorwise (64, 128) weight in one fragment: the tables' dtypes and the integer arguments' divisibility
        # are what the compile specializes on, not the values.
        return dict(master=torch.zeros(n, dtype=master_dtype), master_scale=torch.ones(1),
                    frag_of_group=torch.zeros(groups, dtype=torch.int64),
                    index_offset=torch.zeros(groups, dtype=torch.int64), groups=torch.arange(groups),
                    frag_table=torch.tensor([[0, 128, 1 << 62, 1, 1 << 62, n, 0], [1, 1, 1, 1, 1, 0, 0]]),
                    dummy_slot=16)

    for master_dtype, what in ((torch.float32, "fp32 master"), (torch.float16, "fp16 master")):
        yield what, "_group_amax_kernel", lambda d=master_dtype: P.group_amax_triton(**tables(d), amax=torch.zeros(17))
        for formats, fmt in (((0, -1), "e4m3"), ((-1, 0), "e5m2"), ((0, 1), "e4m3+e5m2")):
            def cast(d=master_dtype, formats=formats):
                out = torch.zeros(n, dtype=torch.uint8)
                P.cast_triton(**tables(d), scale=torch.ones(17), dest_buffer=torch.zeros(groups, dtype=torch.int64),
                              dest_offset=torch.arange(groups) * 128,
                              buffer_address=torch.tensor([out.data_ptr()]), formats=formats)
            yield f"{what} into {fmt}", "_cast_kernel", cast


# Every maker of optimizer cases, in audit order.
OPTIMIZER_CASE_MAKERS: tuple[Callable[[], Iterator[tuple[str, str, Callable[[], None]]]], ...] = (
    fp32_adamw_cases, coded_adamw_cases, fp8_publication_cases)


# kernel_audit.py --quick: the default preset's two kernels and the compressed preset's update and publication.
QUICK_CASES = {("_grad_group_squares_kernel", "fp32 grads"), ("_adamw_fp32_kernel", "fp32 grads decay clip"),
               ("_adamw_coded_kernel", "fp16 master fp8 moments"), ("_publish_fp16_master_kernel", "into bf16 weights")}


def optimizer_cases(quick: bool = False) -> Iterator[tuple[str, str, Callable[[], None]]]:
    """(case label, kernel name, call) of every fused optimizer kernel specialization kernel_audit.py compiles
    (--quick: QUICK_CASES)."""
    for make in OPTIMIZER_CASE_MAKERS:
        for label, kernel, call in make():
            if not quick or (kernel, label) in QUICK_CASES:
                yield label, kernel, call
