"""The linear layers' GEMM and cast shapes of the models the GPU runs (bench_train.py's ~1B Llama, the 8B examples),
for kernel_audit.py's "training" cases.

Triton specializes a kernel on its integer arguments (divisible by 16, equal to 1), and some of them are derived
from the shapes: a blockwise GEMM's scale strides are K/128 and N/128, so the audit's 512^3 case (K/128 = 4) is
another compiled kernel than the ~1B model's (K/128 = 16). Compiling these exact shapes puts the kernels training
launches into the Triton cache before gpu_check.sh's timed steps, and holds them to the audit's rule: 0 spills.
tests/test_gpu_check_shapes.py checks that these models are what bench_train.py and examples/*.sh run.
"""
from __future__ import annotations

from typing import NamedTuple


class LlamaShape(NamedTuple):
    """What fixes a Llama block's per-rank GEMM shapes."""

    name: str
    tokens: int  # micro-batch x sequence per rank (after context parallelism), all-gathered under SP
    hidden: int
    ffn: int
    heads: int
    query_groups: int
    tp: int

    @property
    def kv_channels(self) -> int:
        return self.hidden // self.heads

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, out_features, in_features) per rank: column-parallel QKV and FC1 (SwiGLU's gate and up), row-parallel
        projection and FC2."""
        qkv = self.hidden + 2 * self.query_groups * self.kv_channels
        return [("qkv", qkv // self.tp, self.hidden), ("proj", self.hidden, self.hidden // self.tp),
                ("fc1", 2 * self.ffn // self.tp, self.hidden), ("fc2", self.hidden, self.ffn // self.tp)]

    def gemms(self) -> dict[str, list[tuple[int, int, int]]]:
        """(M, N, K) per training GEMM, as linear_function.py runs them: fprop x.W^T, dgrad dY.W, wgrad dY^T.x."""
        shapes = {"fprop": [], "dgrad": [], "wgrad": []}
        for _, out_features, in_features in self.linears():
            shapes["fprop"].append((self.tokens, out_features, in_features))
            shapes["dgrad"].append((self.tokens, in_features, out_features))
            shapes["wgrad"].append((out_features, in_features, self.tokens))
        return {gemm: sorted(set(s)) for gemm, s in shapes.items()}

    def cast_shapes(self) -> list[tuple[int, int]]:
        """(rows, cols) of every tensor quantized on its own: each linear's input and output gradient (tokens x
        features) and weight (out x in)."""
        shapes = set()
        for _, out_features, in_features in self.linears():
            shapes |= {(self.tokens, in_features), (self.tokens, out_features), (out_features, in_features)}
        return sorted(shapes)


# bench_train.py's model (Llama-3.2-1B's transformer, micro-batch 8 x seq 2048, TP=1), the GPU examples: the same 1B at
# micro-batch 4 on one GPU (pretrain_single_gpu.sh), Llama-3-8B at TP=4 with SP, micro-batch 1 x seq 8192
# (pretrain_llama3_8b_fp8.sh), and at seq 32k with CP=2: 16384 tokens per rank (pretrain_llama3_8b_32k_cp.sh).
TRAINING_SHAPES = (
    LlamaShape("bench_train 1B", tokens=8 * 2048, hidden=2048, ffn=8192, heads=32, query_groups=8, tp=1),
    LlamaShape("1B single GPU", tokens=4 * 2048, hidden=2048, ffn=8192, heads=32, query_groups=8, tp=1),
    LlamaShape("8B TP4", tokens=8192, hidden=4096, ffn=14336, heads=32, query_groups=8, tp=4),
    LlamaShape("8B TP4 CP2 32k", tokens=32768 // 2, hidden=4096, ffn=14336, heads=32, query_groups=8, tp=4),
)
