"""Test-only: hold megatron-core's checkpoint writers of one save until the test releases them.

Put this folder first on ``PYTHONPATH`` of a training launch and set ``SAVE_GATE_DIR`` (a
folder) and ``SAVE_GATE_MATCH`` (a part of the written files' paths, e.g.
``iter_0000008/``). Python imports this module at start-up in every process of the launch;
once ``megatron.core.dist_checkpointing.strategies.filesystem_async`` is imported, its
``FileSystemWriterAsync.write_preloaded_data`` (the function that writes one ``.distcp``
file: in a forked writer process with megatron-core 0.16, in a writer thread with 0.19)
first creates ``SAVE_GATE_DIR/writing.<RANK>.<pid>.<thread>`` for a matching file, then
waits for ``SAVE_GATE_DIR/release``. A test thereby sends a signal while a save is surely in
flight (its writers hold the data), whatever the machine's speed, then lets it finish.

Without ``SAVE_GATE_DIR`` nothing is changed.
"""

import os

if os.environ.get("SAVE_GATE_DIR"):
    import importlib.abc
    import importlib.util
    import sys
    import threading
    import time

    _TARGET = "megatron.core.dist_checkpointing.strategies.filesystem_async"
    _GATE = os.environ["SAVE_GATE_DIR"]
    _MATCH = os.environ.get("SAVE_GATE_MATCH", "")

    def _patch(module):
        cls = module.FileSystemWriterAsync
        original = cls.write_preloaded_data

        def write_preloaded_data(transform_list, local_proc_idx, write_bucket, *args, **kwargs):
            if _MATCH in str(write_bucket[0]):
                name = f"writing.{os.environ.get('RANK', '0')}.{os.getpid()}"
                open(os.path.join(_GATE, f"{name}.{threading.get_ident()}"), "w").close()
                while not os.path.exists(os.path.join(_GATE, "release")):
                    time.sleep(0.05)
            return original(transform_list, local_proc_idx, write_bucket, *args, **kwargs)

        cls.write_preloaded_data = staticmethod(write_preloaded_data)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def patched_exec_module(module):
                exec_module(module)
                _patch(module)

            spec.loader.exec_module = patched_exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
