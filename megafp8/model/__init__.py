"""Llama-style GPT built from tensor-parallel layers: config, norm, rotary, attention, MLP, model, HF mapping."""
from megafp8.model.config import ModelConfig
from megafp8.model.model import GPTModel, TransformerLayer

__all__ = ["GPTModel", "ModelConfig", "TransformerLayer"]
