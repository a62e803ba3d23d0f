"""An import finder for a package ComfyUI imports at start-up that a test never calls, in a module that imports
nothing but the standard library (ComfyUI's server, started by tests/gpu/soak.py, must import torch itself: its main.py chooses the CUDA
allocator first)."""

from __future__ import annotations

import importlib.machinery  # here, not in find_spec: importing it there asked this finder again, without end
import importlib.util
import sys


def stand_in_if_missing(name: str) -> bool:
    """An :class:`AbsentPackage` for ``name`` first on the import path where this Python cannot import it (once per
    process); True where it is a stand-in."""
    if any(isinstance(f, AbsentPackage) and f.name == name for f in sys.meta_path):
        return True
    if importlib.util.find_spec(name) is not None:
        return False
    sys.meta_path.insert(0, AbsentPackage(name))
    return True


class AbsentPackage:
    """An import finder that answers every ``<name>`` and ``<name>.*`` import with an empty module whose attributes are
    empty classes (and theirs too): a package ComfyUI imports at start-up but a test never calls (PyAV on the GPU
    machine)."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    class _Empty(type):
        """An empty class whose every attribute is another empty class (enum members read at import time)."""

        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(cls)(name, (), {})

    def create_module(self, spec):
        import types

        def attr(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self._Empty(name, (), {})

        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = attr
        return mod

    def exec_module(self, module):
        pass
