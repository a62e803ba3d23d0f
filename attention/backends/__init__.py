"""Backend modules: every module in this folder is imported, and importing one registers its entries in ``REGISTRY``.

Adding a backend is one module here with its ``REGISTRY.register(...)`` calls (and its test). Where install.py should
install its package, that package's entry in ``attention.capabilities.KERNELS`` (how to get it, the GPUs it runs on,
the backend names it provides) is its install recipe; the registry takes the package's GPU window from there.
"""

import importlib
import pkgutil

from ..registry import REGISTRY

FIRST = "sdpa"  # PyTorch's own: the reference and last fallback, registered (and listed) first


def discover() -> None:
    """Import every backend module on this package's path that is not imported yet (``sdpa`` first, then by name),
    then check the capability table against what registered."""
    names = sorted((m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")),
                   key=lambda n: (n != FIRST, n))
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    REGISTRY.check_table()


discover()
