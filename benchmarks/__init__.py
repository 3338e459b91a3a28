"""Benchmarks of megatron-ext: compression kernels, step time against bandwidth, convergence.

Each script (``kernels.py``, ``step_time.py``, ``convergence.py``) runs as
``python benchmarks/<name>.py`` or ``python -m benchmarks.<name>`` from the repository root,
prints a table and writes a JSON report into its run directory; ``megatron-ext report``
(:mod:`megatron_ext.report`) turns run directories into plots and a markdown summary.
Shared helpers live in :mod:`benchmarks.common`.
"""
