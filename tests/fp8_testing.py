"""Helpers shared by the FP8 tests: SQNR in dB and realistic inputs with outlier channels."""
import torch


def sqnr_db(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB (computed in fp64)."""
    reference = reference.double()
    noise = (actual.double() - reference).pow(2).mean()
    return (10 * torch.log10(reference.pow(2).mean() / noise)).item()


def gaussian_with_outlier_channels(rows: int, cols: int, generator: torch.Generator, outliers: int = 4,
                                   magnitude: float = 20.0) -> torch.Tensor:
    """N(0, 1) data where a few columns (channels) are `magnitude` times larger, as in LLM activations."""
    x = torch.randn(rows, cols, generator=generator)
    channels = torch.randperm(cols, generator=generator)[:outliers]
    x[:, channels] *= magnitude
    return x


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def attach_main_grads(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every parameter a zeroed `main_grad` of `dtype` and the hook the ZeRO grad buffer installs (the
    contract in docs/fp8.md): a gradient that autograd put in `.grad` is added to `main_grad` and freed.
    The FP8 op writes its parameters' gradients into `main_grad` itself; the hook then sees `.grad` None."""
    def move_grad(param: torch.Tensor) -> None:
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None

    for param in module.parameters():
        param.main_grad = torch.zeros_like(param, dtype=dtype)
        param.register_post_accumulate_grad_hook(move_grad)


class SavedBytes:
    """Counts the bytes autograd saves for backward, excluding parameters (and views of them)."""

    def __init__(self, params):
        self.param_ptrs = {p.data_ptr() for p in params}
        self.nbytes = 0

    def pack(self, t):
        if t.data_ptr() not in self.param_ptrs:
            self.nbytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
