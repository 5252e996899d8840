"""Shared pieces of the conversion tests: a tiny random Hugging Face Llama on disk, the CLI, tensor readers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from data_fixtures import REPO_ROOT

TOLERANCE = 1e-5  # fp32 end to end: only summation order differs


def tiny_hf_llama(directory: Path, *, tie: bool, vocab_size: int = 100, num_layers: int = 2,
                  max_shard_size: str = "50KB", seed: int = 0, **config_fields):
    """A random GQA LlamaForCausalLM (norm weights random too, so a swapped norm shows) saved sharded;
    ``config_fields`` override LlamaConfig's (e.g. ``max_position_embeddings``, ``rope_parameters``)."""
    import transformers

    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6,
                  rope_theta=500000.0, tie_word_embeddings=tie, attn_implementation="eager")
    config = transformers.LlamaConfig(**{**fields, **config_fields})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return model


def convert(*args: str) -> subprocess.CompletedProcess:
    """tools/convert_checkpoint.py as a user runs it."""
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--no-progress", *map(str, args)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def checkpoint_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every ``model.*`` tensor of the checkpoint the tracker names, as full tensors (DCP reshards)."""
    iteration = int((root / "latest_checkpointed_iteration.txt").read_text())
    path = root / f"iter_{iteration:07d}"
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.items() if k.startswith("model.") and hasattr(m, "chunks")}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()
