"""Backend modules; importing one registers its entries in ``REGISTRY``.

Adding a backend: write one module here with its ``REGISTRY.register(...)``
call, and add its name to ``MODULES``.
"""

import importlib

MODULES = ("sdpa", "flash", "sage", "sparge", "xformers", "kitchen")

for _m in MODULES:
    importlib.import_module(f"{__name__}.{_m}")
