"""The one exception type every user-facing checkpoint problem raises (bad path, corrupt file, flag mismatch)."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded; the message names the path or flag and what to do.

    The training entry catches it and prints the message alone (no traceback): the cause is a file or a
    flag, not a bug in megafp8.
    """
