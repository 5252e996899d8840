"""xIELU (`--activation xielu`, FOG's non-gated MLP; megafp8/model/xielu.py) against its peer, transformers'
XIELUActivation (Apertus), in fp64: values and the gradients of the input and of both trainable scalars, with the
scalars away from their init. The whole model with it is checked in tests/test_fog_block.py (fp64 re-implementation,
TP2+SP x PP2 from scratch); here the training entry trains it in FP8 and the HF export refuses it."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import torch

from convert_testing import convert
from data_fixtures import REPO_ROOT
from megafp8.model.xielu import XIELU
from megafp8.training.arguments import parse_and_check
from megafp8.training.megatron_flags import LLAMA_FLAGS


def test_xielu_matches_transformers_in_values_and_gradients():
    logging.getLogger("transformers").setLevel(logging.ERROR)  # its note that the CUDA kernel is not installed
    from transformers.activations import XIELUActivation

    peer, ours = XIELUActivation(dtype=torch.float64), XIELU(params_dtype=torch.float64)
    assert torch.equal(peer.alpha_p.detach(), ours.alpha_p.detach())  # the same init (alphas 0.8)
    assert torch.equal(peer.alpha_n.detach(), ours.alpha_n.detach())
    with torch.no_grad():
        for module in (peer, ours):
            module.alpha_p.fill_(0.3)
            module.alpha_n.fill_(-0.7)
    x = torch.cat([torch.randn(4000, dtype=torch.float64) * 3, torch.tensor([0.0, -1e-7, 1e-7, -40.0, 40.0],
                                                                            dtype=torch.float64)])
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [peer(xs[0]), ours(xs[1])]
    assert torch.allclose(outs[0], outs[1], rtol=1e-15, atol=1e-15)
    dy = torch.randn_like(x)
    for out in outs:
        out.backward(dy)
    assert torch.allclose(xs[0].grad, xs[1].grad, rtol=1e-14, atol=1e-14)
    for name in ("alpha_p", "alpha_n"):
        a, b = getattr(peer, name).grad, getattr(ours, name).grad
        assert torch.allclose(a, b, rtol=1e-12), name


def test_training_entry_trains_xielu_in_fp8_and_the_hf_export_refuses_it(tmp_path):
    flags = [*LLAMA_FLAGS, "--activation", "xielu", "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
             "--log-interval", "1", "--eval-iters", "0", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
             "--train-iters", "3", "--save", str(tmp_path / "run"), "--save-interval", "3"]
    args, errors, _ = parse_and_check(flags)
    assert errors == [] and args.ffn_hidden_size == 4 * 64  # non-gated: Megatron's 4h
    result = subprocess.run([sys.executable, "-m", "megafp8.pretrain", *flags], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("lm loss:") == 3
    exported = convert("--load-format", "megafp8", "--save-format", "hf", "--load-dir", tmp_path / "run",
                       "--save-dir", tmp_path / "hf")
    assert exported.returncode == 1 and "--activation xielu has no HF Llama equivalent" in exported.stderr
