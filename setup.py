"""Installs `megafp8` and the Triton kernel package (folder `kernels/`, import name `megafp8_kernels`)."""
from setuptools import find_packages, setup

setup(
    name="megafp8",
    version="0.1.0",
    description="Megatron-style 3D-parallel LLM pretraining in FP8 end to end",
    python_requires=">=3.10",
    # `kernels` as a bare import name would shadow the PyPI package `kernels` (used by transformers).
    packages=find_packages(include=["megafp8", "megafp8.*"]) + ["megafp8_kernels"],
    package_dir={"megafp8_kernels": "kernels"},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "tqdm",
        "triton; platform_system == 'Linux'",
    ],
    extras_require={
        # Peers the tests compare against: transformers (HF Llama), megatron-core (.bin/.idx, data order, LR
        # schedule), torchao (low-bit AdamW, MX/NVFP4 references), accelerate (transformers needs it to load an FP8
        # export), compressed-tensors (what reads an hf-nvfp4 export: transformers loads it through it);
        # tensorboard and matplotlib are what the reports write with; wandb what --wandb-project logs with.
        "test": ["pytest", "pytest-xdist", "transformers", "safetensors", "sentencepiece", "tokenizers", "megatron-core", "torchao",
                 "tensorboard", "matplotlib", "accelerate", "wandb", "compressed-tensors"],
        "data": ["sentencepiece", "tokenizers"],
        # What --tensorboard-dir writes with; the README's main job (examples/quickstart.sh) installs
        # `.[data,tensorboard]`, exactly what it runs (tests/test_quickstart.py runs that line in a fresh venv).
        "tensorboard": ["tensorboard"],
        "report": ["matplotlib", "tensorboard"],
        # What --wandb-project logs with (WANDB_MODE=offline needs no network or account).
        "wandb": ["wandb"],
    },
    entry_points={
        "console_scripts": [
            "megafp8-pretrain = megafp8.pretrain:main",
        ],
    },
)
