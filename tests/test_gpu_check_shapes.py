"""The shapes kernel_audit.py compiles as "training" cases (tools/bench/audit_training_shapes.py) are the models the GPU
runs: bench_train.py's ~1B Llama and every GPU example's model and layout; and none of their GEMMs falls under the
audit's known spill (wgrad into fp32 at an N that is not a multiple of 16), so a spill there always fails the audit."""
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "bench"))
import audit_training_shapes  # noqa: E402
import bench_train  # noqa: E402
import kernel_audit  # noqa: E402
from audit_training_shapes import TRAINING_SHAPES, LlamaShape  # noqa: E402

GPU_EXAMPLES = ("pretrain_single_gpu.sh", "pretrain_llama3_8b_fp8.sh", "pretrain_llama3_8b_32k_cp.sh")


def _flag(flags: str, name: str, default: int | None = None) -> int:
    found = re.findall(rf"--{name}[ =](\d+)", flags)
    if not found:
        assert default is not None, f"--{name} missing"
        return default
    assert len(set(found)) == 1, (name, found)
    return int(found[0])


def _shape_of(name: str, flags: str) -> LlamaShape:
    tokens = _flag(flags, "micro-batch-size") * _flag(flags, "seq-length") // _flag(flags, "context-parallel-size", 1)
    return LlamaShape(name, tokens=tokens, hidden=_flag(flags, "hidden-size"), ffn=_flag(flags, "ffn-hidden-size"),
                      heads=_flag(flags, "num-attention-heads"), query_groups=_flag(flags, "num-query-groups"),
                      tp=_flag(flags, "tensor-model-parallel-size", 1))


def _same_model(a: LlamaShape, b: LlamaShape) -> bool:
    return a._replace(name="") == b._replace(name="")


def test_bench_train_model_is_audited():
    flags = " ".join(bench_train.model_flags(quick=False, iters=4))
    assert _same_model(_shape_of("bench_train", flags), TRAINING_SHAPES[0])


@pytest.mark.parametrize("script", GPU_EXAMPLES)
def test_every_gpu_example_model_is_audited(script):
    shape = _shape_of(script, (REPO / "examples" / script).read_text())
    assert any(_same_model(shape, audited) for audited in TRAINING_SHAPES), (shape, TRAINING_SHAPES)


def test_no_training_gemm_is_a_known_spill():
    """Every training GEMM dimension is a multiple of 16 (Triton specializes it alike), so known_spill never excuses a
    training shape; the audit's odd 70x90x300 case stands for shapes no model here has."""
    from megafp8_kernels import gemm as G
    from megafp8_kernels.scaling import GemmScaleMode

    for model in TRAINING_SHAPES:
        for gemm, shapes in model.gemms().items():
            for shape in shapes:
                assert all(d % 16 == 0 for d in shape), (model.name, gemm, shape)
                case = kernel_audit.GemmCase(G.SM90_DEFAULT_CONFIG, True, GemmScaleMode.TENSORWISE, shape, False,
                                             "triton", gemm, "e5m2", "fp32", gemm == "wgrad")
                assert kernel_audit.known_spill(case) is None
    odd = kernel_audit.GemmCase(G.SM90_DEFAULT_CONFIG, True, GemmScaleMode.TENSORWISE, (70, 90, 300), False,
                                "triton", "wgrad", "e5m2", "fp32", True)
    assert kernel_audit.known_spill(odd) is not None
    assert kernel_audit.known_spill(odd._replace(precise_kernel="gluon")) is None  # the Gluon kernel does not spill


def test_llama_gemm_shapes_by_hand():
    """The 1B model's per-rank GEMMs written out: QKV 2048 -> 2048 + 2 x 8 x 64, FC1 -> 2 x 8192 (SwiGLU)."""
    model = audit_training_shapes.TRAINING_SHAPES[0]
    assert model.linears() == [("qkv", 3072, 2048), ("proj", 2048, 2048), ("fc1", 16384, 2048), ("fc2", 2048, 8192)]
    assert (16384, 3072, 2048) in model.gemms()["fprop"] and (3072, 2048, 16384) in model.gemms()["wgrad"]
    assert (16384, 8192, 2048) in model.gemms()["dgrad"]  # dY of FC2 (2048 wide) x W2 -> 8192
