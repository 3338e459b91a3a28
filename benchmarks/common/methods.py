"""The methods a benchmark runs, from the registry: their flags, choices and settings.

:func:`add_family_args` adds ``--family`` and ``--methods`` to a benchmark's parser and
:func:`family_methods` reads them back, :func:`add_method_args` adds every registered method's
options, :func:`method_choices` lists a family's methods, :class:`MethodSettings` resolves the
options each method runs with (given flags, then the method's benchmark defaults, then its own).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks.common.models import gpt_matrix_shapes, load_model_preset
from benchmarks.common.runs import parse_list

__all__ = [
    "add_family_args",
    "check_methods",
    "family_methods",
    "add_method_args",
    "method_choices",
    "MethodSettings",
]

_FAMILIES = {
    "grad": "data-parallel gradient compression",
    "p2p": "pipeline activation compression",
    "linear": "the row-sparse linear backward",
    "subspace": "the subspace-confined residual stream",
}
"""The method families a training benchmark runs (``--family``), with their ``--help`` words."""


def add_family_args(p: Any, notes: Optional[Mapping[str, str]] = None) -> None:
    """``--family`` (default grad) and ``--methods`` (a comma-separated subset of the family's
    registered methods, default all); ``--family``'s help lists each family's methods, then
    the benchmark's note on it from ``notes`` (family -> text)."""
    notes = notes or {}
    families = []
    for name, what in _FAMILIES.items():
        note = f"; {notes[name]}" if name in notes else ""
        families.append(f"{what} ({name}; {method_choices(name)}{note})")
    p.add_argument(
        "--family",
        choices=tuple(_FAMILIES),
        default="grad",
        help=f"Which methods --methods names: {' or '.join(families)}. Default grad.",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="Comma-separated subset of the family's registered methods (default: all).",
    )


def check_methods(names: Sequence[str], family: str, prog: str) -> bool:
    """Whether every one of ``names`` is a registered ``family`` method; else prints
    ``<prog>: error: unknown <family> method ...`` for the first that is not."""
    for name in names:
        if name not in method_choices(family):
            print(
                f"{prog}: error: unknown {family} method {name!r} (choose from "
                f"{method_choices(family)})"
            )
            return False
    return True


def family_methods(args: Any, prog: str) -> Optional[List[str]]:
    """The methods of ``--methods`` (unset: every registered method of ``--family``, written
    back into ``args.methods``), or ``None`` after :func:`check_methods` printed the error."""
    if args.methods is None:
        args.methods = ",".join(method_choices(args.family))
    methods = parse_list(args.methods)
    return methods if check_methods(methods, args.family, prog) else None


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
