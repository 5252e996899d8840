"""Test session setup: one torch thread per process; on machines without CUDA, Triton kernels run in Triton's
interpreter; the longest files run first."""
import os

# Two xdist workers share the 2-core CI machine and many tests run their ranks in more processes: torch's intra-op pool
# (a thread per core, spinning between ops) then oversubscribes the cores and small ops slow down many times over
# (measured: a test of 8 s alone took 41 s beside two busy processes with the default threads, 14 s with one). One
# thread for the workers and, through the environment, for every process a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Must happen before megafp8_kernels is imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


# The longest files first (minutes each on the 2-core CI machine): the two xdist workers (pytest.ini, one file each at
# a time) then finish together, instead of one running a 5-minute file alone at the end.
LONGEST_FIRST = ("test_kernel_audit.py", "test_fp8_parity_example.py", "test_training_3d.py",
                 "test_microscaling_training.py", "test_compile_training.py", "test_quickstart.py",
                 "test_context_parallel_training.py", "test_moe_training.py", "test_kernel_audit_blackwell.py",
                 "test_grad_noise_trigger.py", "test_docs.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other files keep their order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
