"""The training product: arguments, the 3D training loop, evaluation, and logging (console, metrics.jsonl, TensorBoard)."""
