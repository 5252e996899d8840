"""Keep torch's custom ops from importing torch._dynamo on their first eager call (1.2 s of every rank's start).

``torch.library.custom_op`` wraps each backend function in ``torch._disable_dynamo``, which imports torch._dynamo
the first time the op runs, only to build the wrapper that keeps dynamo out of the function's frames. Until a
process has imported torch._dynamo nothing can be compiling (torch.compile imports it), so there is no frame to
keep dynamo out of: ``run_eagerly_until_dynamo`` gives each backend the wrapper torch caches on first use
(``fn.__dynamo_disable``), one that calls the function directly while torch._dynamo is not loaded and builds
torch's own ``torch._dynamo.disable`` wrapper once it is (``--compile``, or a test compiling in the same process).
Where this torch lays its custom ops out differently the op is left as torch made it (only the start is slower).
"""
from __future__ import annotations

import sys
from collections.abc import Callable


def run_eagerly_until_dynamo(op) -> None:
    """For each backend of ``op`` (a ``torch.library.custom_op`` result) that torch wrapped in _disable_dynamo."""
    for backend in getattr(op, "_backend_fns", {}).values():
        fn = getattr(backend, "__wrapped__", None)  # the function _disable_dynamo's wrapper calls
        if fn is not None and getattr(fn, "__dynamo_disable", None) is None:
            setattr(fn, "__dynamo_disable", _dynamo_disabled_once_loaded(fn))


def _dynamo_disabled_once_loaded(fn: Callable) -> Callable:
    disabled = None

    def call(*args, **kwargs):
        nonlocal disabled
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:  # nothing compiled in this process yet
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = dynamo.disable(fn, recursive=True)
            # From now on torch's wrapper calls it directly: this frame, outside torch's files, is never traced.
            setattr(fn, "__dynamo_disable", disabled)
        return disabled(*args, **kwargs)

    return call
