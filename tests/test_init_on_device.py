"""The training entry builds its model on the target device (megafp8.parallel.random.build_on_device): the
same parameters and buffers as a model built the plain way (the TP=1 GPTModel, bit for bit; a TP=2 build's
shards concatenate to it, a PP=2 build's stages hold its tensors, the tied head included), and each weight is
allocated once, on the target, just before its one draw there (a TorchDispatchMode over the build). The
plain build fails that last check: it allocates every weight while building the layers, draws them later."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed_testing import run_distributed
from megafp8.fp8 import Fp8Recipe
from megafp8.model import GPTModel, ModelConfig
from megafp8.parallel.parallel_state import ParallelState
from megafp8.parallel.pipeline import build_pipeline
from megafp8.parallel.random import build_on_device
from megafp8.parallel.sharding import gather_tensor_model_parallel


def _config(tie: bool) -> ModelConfig:
    # vocab 100 pads to 104 at TP=1, 112 at TP=2: the padding rows differ between layouts.
    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                       seq_length=8, vocab_size=100, make_vocab_size_divisible_by=8, tie_embeddings=tie, seed=11)


def _pipeline(cfg: ModelConfig, ps: ParallelState, device="cpu", recipe: Fp8Recipe | None = None):
    return build_pipeline(cfg, ps, micro_batch_size=1, num_microbatches=2 * ps.pp_size, fp8_recipe=recipe, device=device)


def _assert_same_module(built: torch.nn.Module, plain: torch.nn.Module, case: str) -> None:
    params, buffers = dict(plain.named_parameters()), dict(plain.named_buffers())
    assert [name for name, _ in built.named_parameters()] == list(params), case
    for name, param in built.named_parameters():
        expected = params[name]
        assert param.dtype == expected.dtype and param.device == expected.device, (case, name)
        assert torch.equal(param, expected), (case, name)
        assert param.__dict__.keys() == expected.__dict__.keys(), (case, name, "sharding tags and init_method kept")
    assert [name for name, _ in built.named_buffers()] == list(buffers), case
    for name, buffer in built.named_buffers():
        assert torch.equal(buffer, buffers[name]), (case, name)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_built_on_device_equals_the_plain_build_tp1(tie):
    cfg = _config(tie)
    ps = ParallelState().init_process_groups()
    for recipe in (None, Fp8Recipe.delayed(amax_history_len=4)):  # FP8: the scaling-state buffers too
        plain = GPTModel(cfg, ps, fp8_recipe=recipe)
        built = _pipeline(cfg, ps, recipe=recipe).chunks[0]
        _assert_same_module(built, plain, f"tie={tie} recipe={recipe}")
        assert torch.all(built.final_layernorm.weight == 1) and torch.all(built.layers["0"].input_layernorm.weight == 1)


class _AllocationsAndDraws(TorchDispatchMode):
    """Each real (non-meta) allocation and each normal_ draw, in order, by the storage they touch. The
    allocated tensors are kept alive so no address is reused by a later allocation."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, int, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.normal_:
            self.events.append(("draw", args[0].untyped_storage().data_ptr(), args[0]))
            return out
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor) and a.device.type != "meta"}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > 0:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs:
                    self.events.append(("alloc", ptr, t))
        return out


def _allocation_problems(build, device: str) -> tuple[torch.nn.Module, list[str]]:
    """Build under the recorder; what breaks "each weight allocated once on ``device``, right before its one
    draw there, and no other tensor of a parameter's shape (no temporary, no host copy)"."""
    with _AllocationsAndDraws() as recorder:
        model = build()
    params = list(model.named_parameters())
    problems = []
    param_shapes = [tuple(p.shape) for _, p in params]
    copies = [t for kind, _, t in recorder.events if kind == "alloc" and tuple(t.shape) in param_shapes]
    if len(copies) != len(params):
        problems.append(f"{len(copies)} allocations of a parameter's shape for {len(params)} parameters")
    for name, param in params:
        ptr = param.untyped_storage().data_ptr()
        touching = [(i, kind, t) for i, (kind, p, t) in enumerate(recorder.events) if p == ptr]
        allocs = [(i, t) for i, kind, t in touching if kind == "alloc"]
        draws = [i for i, kind, _ in touching if kind == "draw"]
        if len(allocs) != 1 or allocs[0][1].device.type != torch.device(device).type:
            problems.append(f"{name}: allocated {len(allocs)} times, not once on {device}")
            continue
        if hasattr(param, "init_method") and (len(draws) != 1 or draws[0] != allocs[0][0] + 1):
            problems.append(f"{name}: {len(draws)} draws into it, not one right after its allocation")
    return model, problems


def test_each_weight_is_allocated_once_on_the_device_then_drawn_there():
    cfg = _config(tie=False)
    ps = ParallelState().init_process_groups()
    built, problems = _allocation_problems(lambda: _pipeline(cfg, ps).chunks[0], "cpu")
    assert problems == []
    _assert_same_module(built, GPTModel(cfg, ps), "after the recorded build")
    # The check has teeth: the plain build allocates every weight while building the layers and draws them
    # only at the end of GPTModel.__init__ (and at HEAD~ into a temporary, then copied).
    _, plain_problems = _allocation_problems(lambda: GPTModel(cfg, ps), "cpu")
    assert any("not one right after its allocation" in p for p in plain_problems), plain_problems


def test_a_weight_without_init_method_is_refused():
    class Uninitialized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4))

    from megafp8.parallel.random import initialize_parameters
    with build_on_device("cpu"), pytest.raises(ValueError, match="'weight' was allocated with torch.empty"):
        initialize_parameters(Uninitialized(), 0, 0, 1)


def _layouts_body(rank: int, world_size: int) -> None:
    tp2 = ParallelState(world_size=world_size, tensor_model_parallel_size=world_size,
                        sequence_parallel=True).init_process_groups()
    pp2 = ParallelState(world_size=world_size, pipeline_model_parallel_size=world_size).init_process_groups()
    for tie in (False, True):
        cfg = _config(tie)
        plain = GPTModel(cfg, ParallelState().init_process_groups())  # the TP=1 reference, built the plain way
        plain_params, plain_buffers = dict(plain.named_parameters()), dict(plain.named_buffers())
        chunk = _pipeline(cfg, tp2).chunks[0]
        for name, param in chunk.named_parameters():
            full = gather_tensor_model_parallel(param.detach(), param, tp2.tp_group)
            expected = plain_params[name]
            if getattr(param, "padded_vocab", False):
                assert torch.all(full[cfg.vocab_size:] == 0), (name, "vocab padding rows are zero")
                full, expected = full[:cfg.vocab_size], expected[:cfg.vocab_size]
            assert torch.equal(full, expected), (f"TP=2 tie={tie}", name)
        for name, buffer in chunk.named_buffers():
            assert torch.equal(buffer, plain_buffers[name]), (f"TP=2 tie={tie}", name)
        chunk = _pipeline(cfg, pp2).chunks[0]
        for name, param in chunk.named_parameters():
            source = "embedding.weight" if tie and name == "output_layer.weight" else name
            assert torch.equal(param, plain_params[source]), (f"PP=2 stage {rank} tie={tie}", name)
        assert ("output_layer.weight" in dict(chunk.named_parameters())) == (rank == 1)


@pytest.mark.distributed
def test_tp2_and_pp2_builds_equal_the_plain_tp1_model():
    run_distributed(_layouts_body, world_size=2)


@pytest.mark.gpu
def test_cuda_build_keeps_no_parameter_on_the_host():
    cfg = _config(tie=True)
    ps = ParallelState().init_process_groups()
    built, problems = _allocation_problems(lambda: _pipeline(cfg, ps, device="cuda").chunks[0], "cuda")
    assert problems == []
    assert all(p.device.type == "cuda" for p in built.parameters())
    assert all(b.device.type == "cuda" for b in built.buffers())
