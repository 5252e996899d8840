"""Megatron-LM legacy rank files for the conversion tests, written without Megatron: what its save_checkpoint stores.

Megatron-LM's ``save_checkpoint`` (legacy ``torch`` format) writes per rank ``{"args": Namespace, "model": state
dict, "optimizer", "opt_param_scheduler", "rng_state", "iteration", "checkpoint_version", ...}``; its ``args``
hold Megatron enums, its RNG state numpy arrays. ``foreign_class`` makes a class pickle under a module name that
does not exist here (or a name the installed module does not have), as a file from another Megatron version does.
``save_megatron_dist_checkpoints`` has Megatron-Core itself write ``torch_dist`` checkpoints (and its logits).
"""
from __future__ import annotations

import argparse
import enum
import random
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from data_fixtures import REPO_ROOT

ARGS = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
            group_query_attention=True, seq_length=16, max_position_embeddings=32, norm_epsilon=1e-5,
            rotary_base=500000, untie_embeddings_and_output_weights=True, swiglu=True, normalization="RMSNorm",
            position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=False, padded_vocab_size=128,
            vocab_size=100, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
# a class newer Megatron-Core versions have and 0.16 does not (the failure), and a package nobody has
FUTURE_ENUM_MODULE = "megatron.core.transformer.enums"
MISSING_MODULE = "nonexistent_pkg.optimizer"


@contextmanager
def foreign_class(cls: type, module_name: str) -> Iterator[type]:
    """While inside, ``cls`` pickles as ``module_name.<its name>`` (fake modules stand in for missing ones)."""
    created, attached, module = [], [], None
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            created.append(name)
            if i > 1:
                parent = sys.modules[".".join(parts[:i - 1])]
                setattr(parent, parts[i - 1], sys.modules[name])
                attached.append((parent, parts[i - 1]))
        module = sys.modules[name]
    cls.__module__, cls.__qualname__ = module_name, cls.__name__
    setattr(module, cls.__name__, cls)
    try:
        yield cls
    finally:
        delattr(module, cls.__name__)
        for parent, attribute in attached:
            delattr(parent, attribute)
        for name in created:
            del sys.modules[name]


# tools/convert_checkpoint.py run where `import megatron...` raises, checking nothing imported it after all
_NO_MEGATRON = """
import runpy, sys
class BlockMegatron:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError(f"{name}: blocked by the test")
sys.meta_path.insert(0, BlockMegatron())
try:
    import megatron.core
    raise SystemExit("the blocker did not block megatron.core")
except ImportError:
    pass
sys.argv = ["tools/convert_checkpoint.py", *sys.argv[1:]]
try:
    runpy.run_path("tools/convert_checkpoint.py", run_name="__main__")
finally:
    assert not [m for m in sys.modules if m.split(".")[0] == "megatron"]
"""


def convert_without_megatron(*args) -> subprocess.CompletedProcess:
    """tools/convert_checkpoint.py in a process where every ``megatron`` import fails."""
    return subprocess.run([sys.executable, "-c", _NO_MEGATRON, "--no-progress", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


class InferenceCudaGraphScope(enum.Enum):
    """Stands in for the enum a newer Megatron-Core pickles into ``args``."""
    none = 0
    block = 1


class DistributedOptimizerState:
    """Stands in for an object of a package that is not installed (Megatron optimizer internals)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.grad_scaler = {"scale": 4096.0}


class RunsCode:
    """Unpickling it with plain pickle runs a shell command: the restricted unpickler must not."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def save_rank_file(root: Path, tp: int, pp: int, model: dict[str, torch.Tensor], *, staged: bool = False,
                   args_class: type = argparse.Namespace, extra_args: dict | None = None, **changes) -> Path:
    """One rank's ``model_optim_rng.pt`` as Megatron-LM writes it (``mp_rank_XX`` at PP=1, ``mp_rank_XX_YYY``
    with stages), its args and state naming classes this process cannot import when it loads them."""
    rank_dir = root / "iter_0000010" / (f"mp_rank_{tp:02d}_{pp:03d}" if staged else f"mp_rank_{tp:02d}")
    rank_dir.mkdir(parents=True, exist_ok=True)
    with foreign_class(InferenceCudaGraphScope, FUTURE_ENUM_MODULE), \
            foreign_class(DistributedOptimizerState, MISSING_MODULE):
        args = args_class(**{**ARGS, **changes}, inference_cuda_graph_scope=InferenceCudaGraphScope.block,
                          **(extra_args or {}))
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.zeros(16, dtype=torch.uint8)}
        optimizer = DistributedOptimizerState({k: torch.zeros_like(v) for k, v in model.items()
                                               if not k.endswith("_extra_state")})
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10, "model": model,
                    "optimizer": {"optimizer": optimizer, "param_groups": [{"lr": 1e-4}]},
                    "opt_param_scheduler": {"num_steps": 10}, "rng_state": [rng],
                    "num_floating_point_operations_so_far": 0}, rank_dir / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    return rank_dir / "model_optim_rng.pt"


def synthetic_megatron_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under Megatron-Core's local-spec names, shaped by ``ARGS`` at TP=1 (norms random too)."""
    generator = torch.Generator().manual_seed(seed)
    h, ffn, heads = ARGS["hidden_size"], ARGS["ffn_hidden_size"], ARGS["num_attention_heads"]
    qkv_rows, vocab = (heads + 2 * ARGS["num_query_groups"]) * (h // heads), ARGS["padded_vocab_size"]
    shapes = {"embedding.word_embeddings.weight": (vocab, h), "decoder.final_layernorm.weight": (h,),
              "output_layer.weight": (vocab, h)}
    for i in range(ARGS["num_layers"]):
        p = f"decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attention.linear_qkv.weight": (qkv_rows, h),
                       p + "self_attention.linear_proj.weight": (h, h), p + "pre_mlp_layernorm.weight": (h,),
                       p + "mlp.linear_fc1.weight": (2 * ffn, h), p + "mlp.linear_fc2.weight": (h, ffn)})
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def expected_megafp8(state: dict[str, torch.Tensor], vocab_size: int = ARGS["vocab_size"]) -> dict[str, torch.Tensor]:
    """The megafp8 checkpoint tensors a TP=1 Megatron-Core state dict converts to, by the documented name map."""
    expected = {"model.embedding.weight": state["embedding.word_embeddings.weight"][:vocab_size],
                "model.output_layer.weight": state["output_layer.weight"][:vocab_size],
                "model.final_layernorm.weight": state["decoder.final_layernorm.weight"]}
    for name, value in state.items():
        if name.startswith("decoder.layers.") and not name.endswith("_extra_state"):
            expected["model." + name.removeprefix("decoder.")] = value
    return expected


def shard_tp2_pp2(state: dict[str, torch.Tensor], root: Path, **save_options) -> None:
    """Megatron-Core's TP=2 x PP=2 cut of a TP=1 state dict (whole query groups per rank, ``[gate_r; up_r]``,
    stage-local layer indices), one rank file each."""
    for tp in range(2):
        for pp in range(2):
            part = {}
            for name, value in state.items():
                if name.endswith("_extra_state"):
                    part[name] = value
                    continue
                if name.startswith("decoder.layers."):
                    layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
                    if int(layer) != pp:
                        continue
                    name = f"decoder.layers.0.{rest}"
                elif name.startswith("embedding.") and pp != 0 or not name.startswith("embedding.") and \
                        not name.startswith("decoder.layers.") and pp != 1:
                    continue
                if name.endswith(("linear_qkv.weight", "word_embeddings.weight")) or name == "output_layer.weight":
                    value = value.chunk(2)[tp]
                elif name.endswith("linear_fc1.weight"):
                    gate, up = value.chunk(2)
                    value = torch.cat([gate.chunk(2)[tp], up.chunk(2)[tp]])
                elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                    value = value.chunk(2, dim=1)[tp]
                part[name] = value.clone()
            save_rank_file(root, tp, pp, part, staged=True, tensor_model_parallel_size=2,
                           pipeline_model_parallel_size=2, **save_options)


# ---- torch_dist (Megatron-Core distributed checkpoints) written by Megatron-Core itself ----------------------

DIST_VOCAB = 100  # the tokenizer's vocab; the model and its checkpoint hold padded_vocab_size (128) rows
DIST_TOKENS = torch.tensor([[3, 17, 42, 99, 0, 5, 64, 12, 7, 88, 23, 51, 9, 70, 31, 2],
                            [60, 1, 14, 33, 95, 8, 47, 26, 81, 4, 19, 58, 11, 73, 36, 90]])


def _megatron_core_on_cpu() -> None:
    """Megatron-Core 0.16 on this path on a CPU-only test process (nothing numeric or on disk changes): the two
    places it assumes CUDA, ``torch.cuda.current_device`` (RoPE's inv_freq device, the DCP writer's success flag)
    and ``torch.cuda.synchronize`` after the writer's host copies; its memory logging through psutil (not
    installed); the writer's result queue, a spawned multiprocessing Manager, as an in-process queue (the save is
    synchronous: the same process reads it); and its forked file writers, which a daemonic test process may not
    start (run_distributed's children are daemonic so that a hung test cannot outlive pytest)."""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    filesystem_async._process_memory = lambda: 0
    filesystem_async._get_write_results_queue = queue.Queue
    multiprocessing.current_process().daemon = False


def _megatron_core_gpt(tp: int, pp: int):
    """Megatron-Core 0.16's GPTModel as ``ARGS`` describes it (local spec, RMSNorm, SwiGLU, GQA, RoPE, untied), this
    rank's part of it at TP=``tp`` x PP=``pp`` (model parallel state initialized here), in eval mode."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    torch.manual_seed(0)  # the same on every rank: use_cpu_initialization draws each full weight, then slices it
    config = TransformerConfig(num_layers=ARGS["num_layers"], hidden_size=ARGS["hidden_size"],
                               ffn_hidden_size=ARGS["ffn_hidden_size"], num_attention_heads=ARGS["num_attention_heads"],
                               num_query_groups=ARGS["num_query_groups"], normalization="RMSNorm",
                               layernorm_epsilon=ARGS["norm_epsilon"], gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               pipeline_dtype=torch.float32)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=ARGS["padded_vocab_size"],
                    max_sequence_length=ARGS["max_position_embeddings"], position_embedding_type="rope",
                    rotary_base=ARGS["rotary_base"], share_embeddings_and_output_weights=False,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage()).eval()


def save_megatron_dist_checkpoints(rank: int, world_size: int, root: str) -> None:
    """A Megatron-Core 0.16 GPTModel at TP=``world_size``: its own forward's logits on ``DIST_TOKENS``
    (``logits.pt``), its per-rank state dicts as legacy rank files (``legacy/``) and ``torch_dist`` checkpoints of
    it, all written by Megatron-Core's ``dist_checkpointing.save``:

    - ``mcore/``: what 0.16 writes for Megatron-LM's state dict: ``common.pt`` (``args``, ``iteration``, ...), layer
      weights stacked over layers (``decoder.layers.<name>``, ``[num_layers, ...]``), norms under TE names,
      ``linear_fc1`` as the global ``[gate; up]``, ``_extra_state`` byte entries;
    - ``lm/``: the layout of Megatron-LM's current save_checkpoint (built from Megatron-Core 0.16's primitives,
      Megatron-LM's training code not being installed): no ``common.pt``, the common state a ``ShardedObject``
      ``common_state`` inside the DCP files, one key per global layer and ``linear_fc1`` as ``weight_w`` /
      ``weight_v`` halves (``singleton_local_shards``);
    - ``pp2/``: the same weights at TP=1 x PP=``world_size``, loaded by Megatron-Core's own (resharding)
      ``dist_checkpointing.load`` from a TP checkpoint, saved again as ``mcore/`` is.
    The ``args`` hold Megatron-Core's own enum and one of a class 0.16 does not have."""
    import contextlib

    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.transformer.enums import AttnBackend

    _megatron_core_on_cpu()
    # eval mode: attention dropout is off, but Megatron still enters its CUDA RNG tracker around it
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    model = _megatron_core_gpt(world_size, 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.uniform_(0.5, 1.5)
        tokens, seq = DIST_TOKENS, DIST_TOKENS.shape[1]
        causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True = masked
        local_logits = model(tokens, torch.arange(seq).expand_as(tokens), attention_mask=causal)  # [b, s, v / TP]
    parts = [torch.empty_like(local_logits) for _ in range(world_size)]
    torch.distributed.all_gather(parts, local_logits.contiguous())
    out = Path(root)
    if rank == 0:
        torch.save(torch.cat(parts, dim=-1)[..., :DIST_VOCAB].clone(), out / "logits.pt")
    # the same model as a legacy checkpoint: each rank's own state dict (Megatron-Core's TP shards) as its rank file
    save_rank_file(out / "legacy", rank, 0, model.state_dict(), vocab_size=DIST_VOCAB,
                   tensor_model_parallel_size=world_size)

    def save(layout: str, state: dict) -> Path:
        directory = out / layout / "iter_0000010"
        if rank == 0:
            directory.mkdir(parents=True)
            (out / layout / "latest_checkpointed_iteration.txt").write_text("10")
        torch.distributed.barrier()
        dist_checkpointing.save(state, str(directory), sharded_strategy=("torch_dist", 1))
        return directory

    # for Megatron's own load below: a common.pt its weights_only torch.load accepts (no enum of a newer version)
    plain = save("tp_plain", {"model": model.sharded_state_dict(), "iteration": 10})
    with foreign_class(InferenceCudaGraphScope, FUTURE_ENUM_MODULE):
        def common(tp: int, pp: int) -> dict:
            args = argparse.Namespace(**{**ARGS, "vocab_size": DIST_VOCAB, "tensor_model_parallel_size": tp,
                                         "pipeline_model_parallel_size": pp},
                                      attention_backend=AttnBackend.auto, ckpt_format="torch_dist",
                                      inference_cuda_graph_scope=InferenceCudaGraphScope.block)
            return {"args": args, "checkpoint_version": 3.0, "iteration": 10, "num_floating_point_operations_so_far": 0}

        save("mcore", {"model": model.sharded_state_dict(), **common(world_size, 1)})
        directory = save("lm", {"model": model.sharded_state_dict(metadata={"singleton_local_shards": True}),
                                "common_state": ShardedObject("common_state", common(world_size, 1), (1,), (0,),
                                                              replica_id=rank)})
        if rank == 0:
            leftover = torch.load(directory / "common.pt", weights_only=False)
            assert not any(leftover.values()), leftover  # nothing but empty containers left outside the DCP
            (directory / "common.pt").unlink()
        staged = _megatron_core_gpt(1, world_size)
        staged.load_state_dict(dist_checkpointing.load({"model": staged.sharded_state_dict()}, str(plain))["model"])
        save("pp2", {"model": staged.sharded_state_dict(), **common(1, world_size)})
