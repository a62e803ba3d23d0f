"""Measurement: benchmarks, calibration, tuning runs and their pictures. Nothing here runs while a patched model samples.

The runtime is ``attention/`` (tensors, kernels, the registry, the dispatcher, ``auto`` and what it checks a kernel
with: :mod:`..attention.reference`) and ``nodes/`` (the ComfyUI adapter: the override, patching, the node
declarations).  This package uses them, never the other way round:

- :mod:`.e2e`: the end-to-end benchmark engine (real ComfyUI sampling, one row per way of running attention), used by
  the Attention Benchmark (end to end) node, ``bench_e2e.py`` and ``tests/gpu``. Its parts: :mod:`.rows` (what a
  row's name means: one table of row kinds), :mod:`.core_nodes` (ComfyUI's own attention nodes as rows),
  :mod:`.peer` (the kernel called straight from the hook), :mod:`.presets` (ComfyUI's model classes at full size),
  :mod:`.stats` (medians, intervals, paired ratios, the exact floor), :mod:`.report` (the table and the targets);
  :mod:`.pictures` draws its results.
- :mod:`.bench`: the kernel-level benchmark (the Attention Benchmark node, ``bench_kernels.py``), on inputs from
  :mod:`.inputs`.
- :mod:`.quality` (PSNR/SSIM of a finished run), :mod:`.calibrate` (the ``auto`` gate and tuning budget against the
  finished run's quality), :mod:`.concentration` (where a video model's attention mass lies): offline analysis.
- :mod:`.sparge_tune`: the Tune Sparse Attention search. The tuning run is a sampling run through the attention hook,
  so its override lives beside the other overrides (``nodes/patch.py``) and imports this module when a tuning run is
  built (``tune_model``), not when the pack loads: patching a model for sampling imports nothing of this package.

What stays in ``attention/`` though it measures: :mod:`..attention.reference` (``auto``, the recheck and the error
reports judge kernels with it during sampling), the timing in :mod:`..attention.auto` (``auto`` times kernels on the
user's calls), :mod:`..attention.stats` (counts during sampling) and :mod:`..attention.report` (Attention Backends Info).

Who imports what: ``nodes/definitions.py`` calls into this package from inside the benchmark nodes' functions, and
``nodes/patch.py`` from inside the tuning run's; no module of ``attention/`` or ``nodes/`` imports it at load time, and
no module here imports ``nodes/definitions.py`` (the node passes what only it knows, such as where profile files
live, as arguments). ``tests/test_layering.py`` holds both rules.
"""
