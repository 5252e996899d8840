"""The host's cost of a training step, measured without a GPU: the real step of examples/pretrain_single_gpu.sh's 1B
model (forward, backward, FP8 scaling update, ZeRO optimizer with its FP8 publication, saturation guard) runs on the
meta device, where no op computes, so what is timed is Python and the dispatcher; set against an H200's time for the
step's FLOPs, it says whether the GPU would wait for the host.

    python tools/bench/bench_host_overhead.py                  # 16 layers, 16 micro-batches: bf16 and 3 FP8 recipes
    python tools/bench/bench_host_overhead.py --compile --json out.json              # also aot_eager-compiled layers
    python tools/bench/bench_host_overhead.py --layers 2 --micro-batches 2 --recipes delayed          # a quick look

What runs as on a GPU, and what stands in for it:
  - the example's flags (bf16: the same without the FP8 ones), vocabulary 128256 (Llama 3), bf16 parameters, one
    process in a one-rank gloo group as under torchrun; token ids are meta tensors (the data loader is not timed);
  - torch's Python meta kernels (its decompositions: 30-100 us per elementwise op) are swapped for ATen's C++ meta
    kernels where one exists (~1 us), as a CUDA dispatch is C++ too; SDPA, which on meta would take its math path
    (~25 ops), runs flash attention's op, as bf16 on an H100/H200 does;
  - the optimizer takes its fused path, as on CUDA: its Triton launches are counted and skipped (nothing launches on
    meta); megafp8's custom ops (FP8 casts and GEMMs) run their fake implementations;
  - a meta op skips the kernel launch itself: `launches` counts those of the step (ATen ops that launch a kernel;
    megafp8 custom ops and Triton kernels), and "host on GPU" adds --launch-us per ATen launch and --triton-launch-us
    per Triton launch to the meta time. CUDA-only stream and event bookkeeping is in neither;
  - --compile adds rows with each layer compiled by megafp8.model.compile.compile_layers(backend="aot_eager"): dynamo
    and AOTAutograd run (no nn.Module overhead) and the traced ATen graph is dispatched op by op, an upper bound of
    inductor's host cost (inductor fuses elementwise ops into fewer launches, but cannot compile for meta).

Definitions. Per layer: one transformer layer's forward + backward of one micro-batch, the slope between this model
and one with half the layers (the embedding, head and loss fall out). GPU ms: the linear layers' GEMM FLOPs at the FP8
(FP8 recipes) or BF16 dense peak, plus attention and logits FLOPs at the BF16 peak, each at --mfu of peak
(megafp8.training.flops counts; the optimizer's memory-bound kernels are left out). host/GPU = host ms / GPU ms
(above 1 the GPU waits); GPU idle = max(0, 1 - GPU ms / host ms): the share of the step the GPU would idle, the host
never waiting for it (the step reads nothing from the device outside log iterations, which are not timed here).
Host-bound above MFU: the MFU at which the GPU's time falls to the host's.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megafp8.fp8 import Fp8Recipe, enable_fp8_telemetry  # noqa: E402
from megafp8.model.compile import compile_layers  # noqa: E402
from megafp8.optim.distributed_optimizer import FUSED_ENV  # noqa: E402
from megafp8.training.arguments import parse_args  # noqa: E402
from megafp8.training.flops import flops_per_iteration  # noqa: E402
from megafp8.training.megatron_flags import LLAMA_FLAGS  # noqa: E402
from megafp8.training.model_setup import model_config_from_args, parallel_state_from_args  # noqa: E402
from megafp8.training.run import build_training_state  # noqa: E402
from megafp8.training.schedules import learning_rate_schedule  # noqa: E402
from megafp8.training.train import saturation_guard  # noqa: E402
from megafp8.training.training_log import device_peak_tflops  # noqa: E402

# examples/pretrain_single_gpu.sh, without its data, checkpoint and log flags (tests/test_bench_host_overhead.py
# checks each pair against the script); --num-layers and --global-batch-size come from --layers / --micro-batches.
MODEL = ("--hidden-size", "2048", "--ffn-hidden-size", "8192", "--num-attention-heads", "32", "--group-query-attention",
         "--num-query-groups", "8", "--seq-length", "2048", "--rotary-base", "500000",
         "--untie-embeddings-and-output-weights", "--bf16")
FP8 = ("--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
       "--fp8-param-gather")
ZERO = ("--use-distributed-optimizer", "--grad-reduce-in-bf16", "--master-weight-dtype", "fp16",
        "--optimizer-state-dtype", "fp8")
TRAINING = ("--micro-batch-size", "4", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "500",
            "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
            "--log-interval", "10")
MICRO_BATCH, LAYERS, MICRO_BATCHES = 4, 16, 16
VOCAB = 128256  # Llama 3's tokenizer (a multiple of 128: no padding rows)
DATA = ("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--train-iters", "20000")
RECIPES = ("bf16", "delayed", "tensorwise", "blockwise")
PHASES = ("forward_backward", "update_fp8_scales", "optimizer", "guard")


def example_flags(recipe: str, layers: int = LAYERS, micro_batches: int = MICRO_BATCHES) -> list[str]:
    """megafp8's argv for the example at `layers` and `micro_batches`; recipe "bf16" drops the FP8 flags."""
    flags = [*LLAMA_FLAGS, *MODEL, *ZERO, *TRAINING, *DATA, "--num-layers", str(layers),
             "--global-batch-size", str(MICRO_BATCH * micro_batches)]
    return flags if recipe == "bf16" else [*flags, *FP8, "--fp8-recipe", recipe]


# ---- the arithmetic ----------------------------------------------------------------------------------------------

def flops_by_precision(samples: int, *, num_layers: int, hidden_size: int, ffn_hidden_size: int,
                       num_attention_heads: int, num_query_groups: int, seq_length: int, padded_vocab_size: int,
                       kv_channels: int | None = None) -> tuple[float, float]:
    """(linear layers' GEMM FLOPs, attention-core + logits FLOPs) of forward + backward over `samples` sequences, as
    megafp8.training.flops counts them: an FP8 recipe runs the first in FP8; flash attention and the output head
    (high precision in the precision map) run in BF16."""
    model = dict(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, num_attention_heads=num_attention_heads,
                 num_query_groups=num_query_groups, seq_length=seq_length, padded_vocab_size=padded_vocab_size,
                 kv_channels=kv_channels)
    total = flops_per_iteration(samples, num_layers=num_layers, **model)
    logits = flops_per_iteration(samples, num_layers=0, **model)
    head_dim = kv_channels if kv_channels is not None else hidden_size / num_attention_heads
    # flops.py's 2 * 2 s h_q per token and layer (QK^T and attention x V), times 3 passes
    attention = 3 * samples * seq_length * num_layers * 4 * seq_length * num_attention_heads * head_dim
    return total - logits - attention, logits + attention


def gpu_ms(linear_flops: float, other_flops: float, linear_peak_tflops: float, other_peak_tflops: float,
           mfu: float) -> float:
    """Milliseconds for the FLOPs at `mfu` of each peak (TFLOP/s)."""
    return 1e3 * (linear_flops / (linear_peak_tflops * 1e12) + other_flops / (other_peak_tflops * 1e12)) / mfu


def host_on_gpu_ms(meta_ms: float, aten_launches: int, triton_launches: int, launch_us: float,
                   triton_launch_us: float) -> float:
    """The meta time plus what each launch would add on a GPU's host."""
    return meta_ms + (aten_launches * launch_us + triton_launches * triton_launch_us) / 1e3


def host_bound(host_ms: float, gpu_ms_: float) -> dict[str, float]:
    """host/GPU and the share of the step the GPU idles (module docstring)."""
    return {"host_over_gpu": host_ms / gpu_ms_, "gpu_idle_fraction": max(0.0, 1.0 - gpu_ms_ / host_ms)}


def breakeven_mfu(host_ms: float, gpu_ms_: float, mfu: float) -> float:
    """The MFU at which the GPU's time falls to the host's: above it the step is host-bound."""
    return mfu * gpu_ms_ / host_ms


# ---- meta as a GPU's host sees it -----------------------------------------------------------------------------

_KEPT_LIBRARIES: list[torch.library.Library] = []  # a Library's registrations end with the object
TRITON_LAUNCHES: collections.Counter[str] = collections.Counter()


def use_cpp_meta_kernels() -> int:
    """Drop torch's Python meta kernels where ATen has a C++ one (a Python registration shadows it: torch's
    activate_meta); the ops with only a Python one keep it (where, flash attention, the embedding). Returns how
    many ops now dispatch to C++. For this process only: there is no undo."""
    import torch._meta_registrations as meta_registrations
    from torch._decomp import global_decomposition_table

    python_library = meta_registrations._meta_lib_dont_use_me_use_register_meta
    registered = set(python_library._op_impls)  # "aten/add.Tensor/Meta"
    kernels: dict = {}
    for table in ("meta", "post_autograd", "pre_autograd"):  # activate_meta's precedence
        for op, kernel in global_decomposition_table[table].items():
            if isinstance(op, torch._ops.OpOverload):
                kernels.setdefault(op, kernel)
    python_only, swapped = {}, 0
    for op, kernel in kernels.items():
        if f"aten/{op.name().split('::', 1)[1]}/Meta" not in registered:
            continue
        if _has_cpp_meta(op):
            swapped += 1
        else:
            python_only[op] = kernel
    python_library._destroy()
    library = torch.library.Library("aten", "IMPL", "Meta")
    for op, kernel in python_only.items():
        library.impl(op, kernel)
    _KEPT_LIBRARIES.append(library)
    return swapped


def _has_cpp_meta(op: torch._ops.OpOverload) -> bool:
    """Whether `op` has a C++ kernel meta tensors can take once the Python one is gone: ATen's meta kernel, or a
    composite one that calls ops which have theirs (new_empty, ones_like: a GPU dispatch runs those too)."""
    registrations = torch._C._dispatch_dump(op.name()).splitlines()
    return any(line.startswith(("Meta (inactive): registered at ", "CompositeExplicitAutograd[alias]: registered at "))
               and ".py:" not in line for line in registrations)


def use_flash_attention_on_meta() -> None:
    """F.scaled_dot_product_attention on meta tensors without a mask or dropout (the model's call) runs flash
    attention's op, the backend CUDA picks for bf16; meta has no backend choice and would run the math path."""
    sdpa = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not query.is_meta or attn_mask is not None or dropout_p:
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = attention


def skip_triton_launches_on_meta() -> None:
    """A Triton launch with a meta tensor argument is counted in TRITON_LAUNCHES and skipped; the launcher's Python
    work up to it (grid, arguments) still runs. Other launches run as before."""
    from triton.runtime.jit import KernelInterface

    launcher = KernelInterface.__getitem__

    def launch(kernel, grid):
        real = launcher(kernel, grid)

        def counted(*args, **kwargs):
            if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                TRITON_LAUNCHES[getattr(kernel, "__name__", type(kernel).__name__)] += 1
                return None
            return real(*args, **kwargs)
        return counted

    KernelInterface.__getitem__ = launch


# Ops that launch no kernel on a GPU (allocation, metadata); views are told apart by the op's schema.
NO_KERNEL_PREFIXES = ("aten::empty", "aten::new_empty", "aten::lift_fresh", "aten::resize_", "aten::set_",
                      "aten::detach", "aten::alias")
HOST_READS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal")


class LaunchCount(TorchDispatchMode):
    """Kernel launches dispatched inside (ATen and megafp8 custom ops), host reads, and ops touching a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.aten = self.custom = 0
        self.host_reads: collections.Counter[str] = collections.Counter()
        self.cpu_ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("megafp8::"):
            self.custom += 1
        elif not func.is_view and not name.startswith(NO_KERNEL_PREFIXES):
            self.aten += 1
        if name in HOST_READS:
            self.host_reads[name] += 1
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_flatten((args, kwargs))[0]):
            self.cpu_ops[name] += 1
        return func(*args, **(kwargs or {}))


# ---- the step -------------------------------------------------------------------------------------------------

class MetaStep:
    """The example's training state for one recipe, built on meta, and its iteration in Trainer.train_step's
    phases (forward_backward, update_fp8_scales, optimizer = prepare + step, guard)."""

    def __init__(self, recipe: str, layers: int, micro_batches: int, compiled: bool) -> None:
        args = parse_args(example_flags(recipe, layers, micro_batches), warn=None)
        parallel_state = parallel_state_from_args(args).init_process_groups()
        # --bf16 gives bf16 parameters on a GPU only (model_setup): the step measured is the GPU's
        config = dataclasses.replace(model_config_from_args(args, VOCAB), params_dtype=torch.bfloat16)
        self.args, self.config = args, config
        self.pipeline, self.ddp, self.optimizer = build_training_state(args, parallel_state, config, device="meta")
        self.compiled_layers = (compile_layers(self.pipeline.chunks, backend="aot_eager", fullgraph=True)
                                if compiled else 0)
        self.guard = None
        if Fp8Recipe.from_args(args) is not None and args.fp8_saturation_guard:
            self.guard = saturation_guard(parallel_state, args.fp8_saturation_guard_threshold,
                                          args.fp8_saturation_guard_patience, read_interval=args.log_interval)
            enable_fp8_telemetry(self.ddp.module, True)  # as the trainer, before the first step
        self.schedule = learning_rate_schedule(args)
        self.input_ids = torch.empty(args.global_batch_size, args.seq_length, dtype=torch.long, device="meta")
        self.iteration = 0

    def phases(self) -> tuple:
        return (("forward_backward", self._forward_backward), ("update_fp8_scales", self.pipeline.update_fp8_scales),
                ("optimizer", self._optimizer), ("guard", self._guard))

    def _forward_backward(self) -> None:
        self.ddp.zero_grad_buffer()
        self.pipeline.forward_backward(self.input_ids, self.input_ids)

    def _optimizer(self) -> None:
        self.optimizer.prepare()
        self.optimizer.step(self.schedule(self.iteration * self.args.global_batch_size))

    def _guard(self) -> None:
        if self.guard is not None:
            enable_fp8_telemetry(self.ddp.module, True)  # the trainer's, every iteration while a guard runs
            self.guard.check(self.ddp.module, self.iteration)

    def _next_iteration(self) -> None:
        # Log iterations read the guard's strikes on the host by design (and cannot on meta): not timed.
        self.iteration += 1
        while self.iteration % self.args.log_interval == 0:
            self.iteration += 1

    def time(self, warmup: int, iterations: int) -> dict[str, float]:
        """Median milliseconds of each phase over `iterations` after `warmup` (compiles, cold FP8 states)."""
        times = collections.defaultdict(list)
        for i in range(warmup + iterations):
            self._next_iteration()
            gc.collect()  # not inside a timed phase
            for name, phase in self.phases():
                start = time.perf_counter()
                phase()
                if i >= warmup:
                    times[name].append(1e3 * (time.perf_counter() - start))
        return {name: statistics.median(times[name]) for name, _ in self.phases()}

    def count(self) -> dict[str, dict]:
        """Per phase: aten / megafp8 custom / Triton launches, host reads and CPU ops of one more iteration."""
        self._next_iteration()
        counts = {}
        for name, phase in self.phases():
            TRITON_LAUNCHES.clear()
            # dynamo refuses to trace under a dispatch mode: a compiled layer is counted running its code eagerly,
            # the ops its graph holds (its FP8 telemetry slot writes included) before AOTAutograd's functionalization
            with torch.compiler.set_stance("force_eager"), LaunchCount() as launches:
                phase()
            counts[name] = {"aten": launches.aten, "triton": launches.custom + sum(TRITON_LAUNCHES.values()),
                            "host_reads": dict(launches.host_reads), "cpu_ops": dict(launches.cpu_ops)}
        return counts

    def real_tensor_bytes(self) -> int:
        """Bytes of every live tensor not on meta (parameters, grad buffers and optimizer states included)."""
        storages = {}
        for t in gc.get_objects():  # plain tensors and parameters: dynamo's fake tensors have no storage
            if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta and t.layout == torch.strided:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()  # views share theirs
        return sum(storages.values())

    def model_state_on_meta(self) -> bool:
        tensors = [*self.pipeline.parameters(), self.optimizer.master.values, self.optimizer.master_scale,
                   *self.ddp.grad_buffers]
        return all(t.is_meta for t in tensors)


def measure(recipe: str, compiled: bool, layers: int, micro_batches: int, warmup: int, iterations: int) -> dict:
    """Host milliseconds and launches per phase of the step, and per layer (the slope against half the layers)."""
    fewer = layers // 2
    if fewer < 1:
        raise ValueError("--layers must be at least 2: a layer's cost is the slope against half the layers")
    start = time.perf_counter()
    step = MetaStep(recipe, layers, micro_batches, compiled)
    build_s = time.perf_counter() - start
    ms, counts = step.time(warmup, iterations), step.count()
    on_meta, real_bytes = step.model_state_on_meta(), step.real_tensor_bytes()
    args, padded_vocab = step.args, step.pipeline.chunks[0].padded_vocab_size
    del step
    small = MetaStep(recipe, fewer, micro_batches, compiled)
    small_ms, small_counts = small.time(warmup, iterations), small.count()
    del small
    per_layer = (layers - fewer) * micro_batches
    layer = {"host_ms": (ms["forward_backward"] - small_ms["forward_backward"]) / per_layer,
             **{kind: (counts["forward_backward"][kind] - small_counts["forward_backward"][kind]) / per_layer
                for kind in ("aten", "triton")}}
    return {"recipe": recipe, "mode": "aot_eager" if compiled else "eager", "layers": layers,
            "micro_batches": micro_batches, "host_ms": ms, "launches": counts, "layer": layer, "build_s": build_s,
            "model_state_on_meta": on_meta, "real_tensor_bytes": real_bytes,
            "model": dict(hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                          num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                          seq_length=args.seq_length, padded_vocab_size=padded_vocab, kv_channels=args.kv_channels),
            "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size}


def estimate(row: dict, peaks: tuple[float, float], mfu: float, launch_us: float, triton_launch_us: float) -> dict:
    """The row with its host time on a GPU's host, the GPU's time and the host-bound figures, per step and layer."""
    bf16, fp8 = peaks
    linear_peak = bf16 if row["recipe"] == "bf16" else fp8
    step_launches = {kind: sum(c[kind] for c in row["launches"].values()) for kind in ("aten", "triton")}
    host_ms = sum(row["host_ms"].values())
    step = {"host_ms": host_ms, **step_launches,
            "host_on_gpu_ms": host_on_gpu_ms(host_ms, step_launches["aten"], step_launches["triton"], launch_us,
                                             triton_launch_us),
            "gpu_ms": gpu_ms(*flops_by_precision(row["global_batch_size"], num_layers=row["layers"], **row["model"]),
                             linear_peak, bf16, mfu)}
    layer_flops = [a - b for a, b in zip(flops_by_precision(row["micro_batch_size"], num_layers=1, **row["model"]),
                                         flops_by_precision(row["micro_batch_size"], num_layers=0, **row["model"]))]
    layer = dict(row["layer"])
    layer["host_on_gpu_ms"] = host_on_gpu_ms(layer["host_ms"], layer["aten"], layer["triton"], launch_us,
                                             triton_launch_us)
    layer["gpu_ms"] = gpu_ms(*layer_flops, linear_peak, bf16, mfu)
    for figures in (step, layer):
        figures.update(host_bound(figures["host_on_gpu_ms"], figures["gpu_ms"]))
        figures["breakeven_mfu"] = breakeven_mfu(figures["host_on_gpu_ms"], figures["gpu_ms"], mfu)
        figures["meta_over_gpu"] = figures["host_ms"] / figures["gpu_ms"]
    return {**row, "step": step, "layer": layer}


def markdown(rows: list[dict]) -> str:
    name = lambda r: f"{'bf16' if r['recipe'] == 'bf16' else 'fp8 ' + r['recipe']} {r['mode']}"  # noqa: E731
    lines = ["Per transformer layer (forward + backward of one micro-batch):", "",
             "| config | host ms (meta) | launches aten + triton | host ms on GPU host | GPU ms | host/GPU | "
             "GPU idle | host-bound above MFU |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x = r["layer"]
        lines.append(f"| {name(r)} | {x['host_ms']:.3f} | {x['aten']:.0f} + {x['triton']:.0f} | "
                     f"{x['host_on_gpu_ms']:.3f} | {x['gpu_ms']:.3f} | {x['host_over_gpu']:.2f} | "
                     f"{100 * x['gpu_idle_fraction']:.0f}% | {x['breakeven_mfu']:.2f} |")
    lines += ["", "Per step (ms; meta, by phase):", "",
              "| config | fwd+bwd | fp8 scales | optimizer | guard | host (meta) | launches aten + triton | "
              "host on GPU host | GPU | host/GPU | GPU idle | host-bound above MFU |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x, ms = r["step"], r["host_ms"]
        lines.append(f"| {name(r)} | {ms['forward_backward']:.1f} | {ms['update_fp8_scales']:.2f} | "
                     f"{ms['optimizer']:.2f} | {ms['guard']:.2f} | {x['host_ms']:.1f} | {x['aten']} + {x['triton']} | "
                     f"{x['host_on_gpu_ms']:.1f} | {x['gpu_ms']:.1f} | {x['host_over_gpu']:.2f} | "
                     f"{100 * x['gpu_idle_fraction']:.0f}% | {x['breakeven_mfu']:.2f} |")
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _peak_rss_mib() -> float:
    """This process's peak RSS: Linux's VmHWM (the high-water mark of this program's own memory; getrusage's
    ru_maxrss survives exec and so reports a large parent's RSS at fork, e.g. a pytest worker's), else getrusage."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated: bf16 and FP8 recipe names")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--micro-batches", type=int, default=MICRO_BATCHES, help="micro-batches of 4 per step")
    parser.add_argument("--compile", action="store_true", help="also time aot_eager-compiled layers")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations (the median is reported)")
    parser.add_argument("--gpu", default="H200", help="whose dense BF16/FP8 peaks (training_log.PEAK_TFLOPS)")
    parser.add_argument("--mfu", type=float, default=0.4, help="the fraction of each peak the GPU reaches")
    parser.add_argument("--launch-us", type=float, default=4.0,
                        help="host microseconds a CUDA launch adds over a meta dispatch (launch + allocator)")
    parser.add_argument("--triton-launch-us", type=float, default=10.0,
                        help="the same for a Triton kernel (or megafp8 custom op), whose launcher is Python")
    parser.add_argument("--python-meta-kernels", action="store_true",
                        help="keep torch's Python meta kernels (slower than any GPU host: for comparison)")
    parser.add_argument("--json", help="write the rows and the assumptions here")
    opts = parser.parse_args(argv)
    peaks = device_peak_tflops(opts.gpu)
    if peaks is None:
        parser.error(f"--gpu {opts.gpu}: no peak known (training_log.PEAK_TFLOPS)")
    os.environ[FUSED_ENV] = "1"  # the optimizer's CUDA path: its Triton launches are counted, not run
    swapped = 0 if opts.python_meta_kernels else use_cpp_meta_kernels()
    use_flash_attention_on_meta()
    skip_triton_launches_on_meta()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:  # one rank, as torchrun's single process
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            for compiled in (False, True) if opts.compile else (False,):
                for recipe in opts.recipes.split(","):
                    row = measure(recipe, compiled, opts.layers, opts.micro_batches, opts.warmup, opts.iterations)
                    rows.append(estimate(row, peaks, opts.mfu, opts.launch_us, opts.triton_launch_us))
                    print(f"{recipe} {row['mode']}: built in {row['build_s']:.1f} s", file=sys.stderr, flush=True)
        finally:
            dist.destroy_process_group()
    peak_rss_mib = _peak_rss_mib()
    print(markdown(rows))
    print(f"\n{opts.gpu} peaks {peaks[0]:g} (BF16) / {peaks[1]:g} (FP8) TFLOP/s at MFU {opts.mfu:g}; launches at "
          f"{opts.launch_us:g} us (ATen) / {opts.triton_launch_us:g} us (Triton); {swapped} ops on C++ meta kernels; "
          f"host {_cpu_name()}, torch {torch.__version__}; peak RSS {peak_rss_mib:.0f} MiB")
    if opts.json:
        assumptions = {"gpu": opts.gpu, "peak_tflops": {"bf16": peaks[0], "fp8": peaks[1]}, "mfu": opts.mfu,
                       "launch_us": opts.launch_us, "triton_launch_us": opts.triton_launch_us,
                       "cpp_meta_kernels": swapped, "vocab_size": VOCAB}
        with open(opts.json, "w") as f:
            json.dump({"command": [sys.executable, *sys.argv], "assumptions": assumptions, "torch": torch.__version__,
                       "machine": platform.platform(), "cpu": _cpu_name(), "cpus": os.cpu_count(),
                       "peak_rss_mib": peak_rss_mib, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
