"""torch.load for foreign checkpoints: tensors and plain containers load, any other class is an inert placeholder.

A Megatron-LM rank file pickles its ``argparse.Namespace`` of flags, whose values include Megatron's own
enums, plus RNG and optimizer state (numpy arrays, Megatron classes). A plain ``torch.load`` imports every
class the file names: it fails when the installed Megatron is older than the one that saved the file, or
absent, and runs whatever code the file points at. Here ``find_class`` returns a real object only for an
allow-list of tensor rebuild functions, storages, dtypes and plain containers (the things
``torch._weights_only_unpickler`` considers safe, plus ``argparse.Namespace`` and a few builtins); any other
name becomes a :class:`Placeholder` subclass that records the qualified name, the arguments the file
constructs it with and the state it sets, and does nothing else. Nothing the file names is imported, so
loading needs no Megatron and runs no code from the file.

Use :func:`load` (``torch.load`` with this module as its ``pickle_module``).
"""
from __future__ import annotations

import _codecs
import _compat_pickle
import argparse
import collections
import pickle
import types
import zipfile
from pathlib import Path
from typing import IO, Any

import torch


class _PlaceholderType(type):
    def __repr__(cls) -> str:
        return f"<placeholder for {cls.qualified_name}>"


class Placeholder(metaclass=_PlaceholderType):
    """An object of a class this loader does not import: holds what the file built it from, runs nothing.

    ``qualified_name`` is the class's (or function's) ``module.name`` as the file spells it; ``args`` /
    ``kwargs`` what the file constructed or called it with (an enum member: its value), ``state`` what it
    set on it (``__setstate__``/``__dict__``), ``items`` / ``elements`` what it stored into it as a dict or
    list (subclasses of dict/list)."""

    qualified_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Placeholder:
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, None
        self.items: dict[Any, Any] = {}
        self.elements: list[Any] = []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # the file may call it too; __new__ recorded all
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, element: Any) -> None:
        self.elements.append(element)

    def extend(self, elements: Any) -> None:
        self.elements.extend(elements)

    def __call__(self, *args: Any, **kwargs: Any) -> Placeholder:  # a placeholder used as a function
        return placeholder_class(f"{self.qualified_name}(...)")(*args, **kwargs)

    def fields(self) -> dict[str, Any]:
        """The attributes the file set on the object (its ``__dict__`` and slots state), by name."""
        state = self.state
        parts = state if isinstance(state, tuple) else (state,)
        return {k: v for part in parts if isinstance(part, dict) for k, v in part.items() if isinstance(k, str)}

    def __repr__(self) -> str:
        shown = ", ".join([repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()])
        return f"<{self.qualified_name}({shown})>"


_PLACEHOLDER_CLASSES: dict[str, type[Placeholder]] = {}


def placeholder_class(qualified_name: str) -> type[Placeholder]:
    """The one Placeholder subclass standing in for ``qualified_name`` (so equal names compare as one type)."""
    cls = _PLACEHOLDER_CLASSES.get(qualified_name)
    if cls is None:
        cls = _PlaceholderType(qualified_name.rpartition(".")[2] or qualified_name, (Placeholder,),
                               {"qualified_name": qualified_name, "__module__": __name__})
        _PLACEHOLDER_CLASSES[qualified_name] = cls
    return cls


def _allowed_globals() -> dict[str, Any]:
    """``module.name`` -> object for everything a tensor checkpoint needs; each is safe to call with any args."""
    allowed: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict, "collections.Counter": collections.Counter,
        "collections.defaultdict": collections.defaultdict, "argparse.Namespace": argparse.Namespace,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.bytearray": bytearray,
        "builtins.complex": complex, "builtins.slice": slice, "builtins.range": range,
        "_codecs.encode": _codecs.encode,  # protocol 2 pickles bytes as encode(latin-1 text)
        "torch.Size": torch.Size, "torch.Tensor": torch.Tensor, "torch.device": torch.device,
        "torch.nn.parameter.Parameter": torch.nn.Parameter,
        "torch.serialization._get_layout": torch.serialization._get_layout,
        "torch._tensor._rebuild_from_type_v2": torch._tensor._rebuild_from_type_v2,
    }
    constants = (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)
    allowed.update({f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, constants)})
    for cls in torch._tensor_classes:
        allowed[f"{cls.__module__}.{cls.__name__}"] = cls
    for cls in torch._storage_classes:  # legacy typed storages reach torch's own StorageType before us
        allowed[f"{cls.__module__}.{cls.__name__}"] = cls
    for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                 "_rebuild_parameter_with_state", "_rebuild_qtensor", "_rebuild_sparse_tensor",
                 "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor", "_rebuild_wrapper_subclass",
                 "_rebuild_device_tensor_from_cpu_tensor"):
        if hasattr(torch._utils, name):  # the set varies a little across torch versions
            allowed[f"torch._utils.{name}"] = getattr(torch._utils, name)
    return allowed


_ALLOWED = _allowed_globals()


class Unpickler(pickle._Unpickler):  # the Python implementation: its dispatch table can be overridden
    """``pickle.Unpickler`` whose ``find_class`` imports nothing: allow-listed objects or placeholders."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals_found: set[int] = set()  # ids of what find_class returned: never BUILD targets

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3 and self.fix_imports:  # protocol 2 (torch.save's) writes Python 2 names
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        qualified = f"{module}.{name}"
        found = _ALLOWED.get(qualified)
        if found is None:
            found = placeholder_class(qualified)
        self.globals_found.add(id(found))
        return found

    def load_build(self) -> None:
        # BUILD sets attributes on the object below it; on a class or function the file names (torch.Tensor,
        # a rebuild function) that would patch this process's code, so only objects the file made are built
        target = self.stack[-2]  # the state is on top
        if id(target) in self.globals_found or isinstance(target, (type, types.FunctionType,
                                                                  types.BuiltinFunctionType)):
            raise pickle.UnpicklingError(f"the file sets attributes on {target!r}, a class or function "
                                         "(not something a checkpoint does)")
        super().load_build()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build


# what torch.load calls on its pickle_module: Unpickler (zip format) and load (the legacy format's headers)
_PICKLE_MODULE = types.SimpleNamespace(__name__=__name__, Unpickler=Unpickler,
                                       load=lambda file, **kwargs: Unpickler(file, **kwargs).load())


def load(file: str | Path | IO[bytes]) -> Any:
    """``torch.load`` of ``file`` onto the CPU through the restricted unpickler (a path is mmapped when it is a
    zip checkpoint, the format of every torch >= 1.6; the legacy format and file objects, such as one entry of
    a DCP file, are read into memory)."""
    is_zip = zipfile.is_zipfile(file)
    if is_zip:
        with zipfile.ZipFile(file) as archive:  # torch.load would hand a TorchScript archive to torch.jit.load
            if any(name.partition("/")[2] == "constants.pkl" for name in archive.namelist()):
                raise pickle.UnpicklingError("a TorchScript archive (torch.jit.save), not a checkpoint")
    is_path = isinstance(file, (str, Path))
    if not is_path:
        file.seek(0)  # is_zipfile read its end
    return torch.load(file, map_location="cpu", pickle_module=_PICKLE_MODULE, weights_only=False,
                      mmap=is_zip and is_path)
