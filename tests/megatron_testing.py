"""Megatron-LM legacy rank files for the conversion tests, written without Megatron: what its save_checkpoint stores.

Megatron-LM's ``save_checkpoint`` (legacy ``torch`` format) writes per rank ``{"args": Namespace, "model": state
dict, "optimizer", "opt_param_scheduler", "rng_state", "iteration", "checkpoint_version", ...}``; its ``args``
hold Megatron enums, its RNG state numpy arrays. ``foreign_class`` makes a class pickle under a module name that
does not exist here (or a name the installed module does not have), as a file from another Megatron version does.
"""
from __future__ import annotations

import argparse
import enum
import random
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

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
