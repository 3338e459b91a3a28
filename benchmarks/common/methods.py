"""The methods a benchmark runs, from the registry: their flags, choices and settings.

:func:`add_method_args` adds every registered method's options to a benchmark's parser,
:func:`method_choices` lists a family's methods, :class:`MethodSettings` resolves the options
each method runs with (given flags, then the method's benchmark defaults, then its own).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from benchmarks.common.models import gpt_matrix_shapes, load_model_preset

__all__ = [
    "add_method_args",
    "method_choices",
    "MethodSettings",
]


def add_method_args(p: Any, family: str = "grad") -> None:
    """The driver's options of every registered ``family`` method (``--separate-ratio``,
    ``--radius-density``, ...), left unset unless given: an unset option takes the method's
    benchmark default (``Method.bench_defaults``), else the method's own default."""
    import argparse

    from megatron_ext.config import add_config_args
    from megatron_ext.methods import registry

    added = set()
    for method in registry.methods(family).values():
        if method.options is not None and method.options not in added:
            added.add(method.options)  # methods may share one options class
            add_config_args(p, method.options, flag_default=argparse.SUPPRESS)


def method_choices(family: str = "grad") -> Tuple[str, ...]:
    """The registered methods of ``family`` (what ``--methods`` accepts)."""
    from megatron_ext.methods import registry

    return registry.choices(family)


class MethodSettings:
    """The options each method runs with in a benchmark: given flags, then the method's
    benchmark defaults, then its own defaults (see :func:`add_method_args`).

    Args:
        args: the benchmark's parsed arguments (``model``, ``iters`` and the method options).
        family: the method family benchmarked.
    """

    def __init__(self, args: Any, family: str = "grad"):
        from megatron_ext.methods import registry

        self.args = args
        self.family = registry.family(family)
        self._methods = registry.methods(family)
        self._resolving: set = set()
        self._cache: Dict[str, Dict[str, Any]] = {}

    def _given(self, method: str) -> Dict[str, Any]:
        import dataclasses

        from megatron_ext.config import flag_of

        cls = self._methods[method].options
        out = {}
        for f in dataclasses.fields(cls):
            dest = flag_of(cls, f.name)[2:].replace("-", "_")
            if hasattr(self.args, dest):
                out[f.name] = getattr(self.args, dest)
        return out

    def options(self, method: str) -> Dict[str, Any]:
        """``{field: value}`` of the options ``method`` runs with (empty without options)."""
        from megatron_ext.methods.registry import BenchContext

        if method in self._cache:
            return self._cache[method]
        spec = self._methods[method]
        if spec.options is None:
            return {}
        values: Dict[str, Any] = {}
        if spec.bench_defaults is not None and method not in self._resolving:
            self._resolving.add(method)
            try:
                shapes = gpt_matrix_shapes(load_model_preset(self.args.model))
                bench = BenchContext(
                    iters=self.args.iters,
                    matrix_shapes=shapes,
                    resolve=lambda other, option: self.options(other).get(option),
                )
                values.update(spec.bench_defaults(bench))
            finally:
                self._resolving.discard(method)
        values.update(self._given(method))
        # Fill in the method's own defaults (and validate) through its dataclass.
        import dataclasses

        instance = spec.options(**values)
        self._cache[method] = {
            f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)
        }
        return self._cache[method]

    def flags(self, method: str) -> List[str]:
        """Driver flags selecting ``method`` with its options."""
        from megatron_ext.config import flag_of

        spec = self._methods[method]
        out = [self.family.flag, method]
        if spec.options is None:
            return out
        defaults = spec.options()
        for name, value in self.options(method).items():
            flag = flag_of(spec.options, name)
            default = getattr(defaults, name)
            if isinstance(value, bool):
                if value != default:
                    out.append(flag if value else "--no-" + flag[2:])
            elif value is None:
                continue
            elif isinstance(value, (list, tuple)):
                out += [flag] + [str(v) for v in value]
            else:
                out += [flag, str(value)]
        return out

    def label(self, method: str, extra_flags: Sequence[str] = ()) -> str:
        """Short name of the configured method, e.g. ``separate-16``, ``g-separate-16``
        (``--separate-adaptive`` among ``extra_flags``), ``powersgd-r14``."""
        import argparse

        from megatron_ext.config import add_args, config_from_args

        spec = self._methods[method]
        if spec.options is None:
            return spec.label(None)
        parser = add_args(argparse.ArgumentParser(allow_abbrev=False))
        ns, _ = parser.parse_known_args(self.flags(method) + list(extra_flags))
        return spec.label(config_from_args(spec.options, ns))
