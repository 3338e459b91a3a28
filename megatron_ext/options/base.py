"""The machinery that turns option dataclasses into command-line flags, and its error type.

What it does:
    :func:`options_dataclass` declares an options class (frozen, keyword-only, its ``--help``
    group and flag prefix); :func:`arg` is the field metadata of a flag (its name, choices,
    aliases);
    :func:`add_config_args` adds one argparse group per options dataclass, a flag per field
    with the field's attribute docstring as help; :func:`config_from_args` goes back from
    parsed arguments to the dataclass; :func:`flag_of` names a field's flag, and
    :class:`ConfigError` (a ``ValueError``) is the one-line refusal that starts with it;
    :func:`check_positive` and :func:`check_choice` raise it.

Why here:
    The option dataclasses (the methods' own, ``megatron_ext.options.*``, and the run-wide
    ones in ``megatron_ext.config``) validate themselves with these helpers; the pure-torch
    packages raise :class:`ConfigError` too. A leaf module lets all of them import it without
    importing the method registry or each other.

Constraints:
    Standard library only: no torch, no Megatron, no other megatron_ext module.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import sys
import textwrap
import typing
from functools import lru_cache
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, TypeVar

__all__ = [
    "ConfigError",
    "options_dataclass",
    "arg",
    "RUN_ONLY",
    "shapes_state",
    "flag_of",
    "check_positive",
    "check_choice",
    "add_config_args",
    "config_from_args",
]


class ConfigError(ValueError):
    """A bad flag value or an unsupported flag combination.

    The message always starts with the flag(s) at fault, e.g.
    ``--grad-compression: 'separate' needs --use-distributed-optimizer off``.
    """

    def __init__(self, flags: Iterable[str] | str, message: str):
        if isinstance(flags, str):
            flags = [flags]
        self.flags = tuple(flags)
        super().__init__(f"{', '.join(self.flags)}: {message}")


_C = TypeVar("_C", bound=type)
_F = TypeVar("_F")

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # Python 3.10: the marker is for type checkers only

    def dataclass_transform(**_: Any) -> Callable[[_F], _F]:
        return lambda decorator: decorator


@dataclass_transform(frozen_default=True, kw_only_default=True)
def options_dataclass(*, group: str, prefix: str) -> Callable[[_C], _C]:
    """Class decorator of an options dataclass: frozen, keyword-only, flags ``--<prefix>-*``.

    Sets the class attributes the flag machinery reads, ``ARG_GROUP`` (the title of the
    class's argument group in ``--help``) and ``ARG_PREFIX`` (``""``: flags ``--<field>``),
    then makes the class a ``dataclass(frozen=True, kw_only=True)`` (declared to type
    checkers with ``typing.dataclass_transform``, so a class's fields are its constructor's
    keywords). Each field's attribute docstring becomes its flag's help.

    Args:
        group: the argument group's title.
        prefix: the flags' prefix.
    """

    def declare(cls: _C) -> _C:
        cls.ARG_GROUP = group
        cls.ARG_PREFIX = prefix
        return dataclasses.dataclass(frozen=True, kw_only=True)(cls)

    return declare


def arg(
    *,
    flag: Optional[str] = None,
    choices: Optional[Tuple[Any, ...]] = None,
    metavar: Optional[str] = None,
    nargs: Optional[str] = None,
    aliases: Tuple[str, ...] = (),
) -> Dict[str, Any]:
    """Field metadata for argparse generation (use as ``field(metadata=arg(...))``).

    Args:
        flag: the flag, overriding ``--<prefix>-<field-name>``.
        choices: allowed values; argparse reports anything else naming the flag.
        metavar: argparse metavar.
        nargs: argparse nargs (for list-valued fields).
        aliases: further spellings of the flag (e.g. Megatron-LM's historical ones).
    """
    return {
        "argparse": {
            "flag": flag,
            "choices": choices,
            "metavar": metavar,
            "nargs": nargs,
            "aliases": tuple(aliases),
        }
    }


RUN_ONLY: Dict[str, Any] = {"shapes_state": False}
"""Field metadata of an option that does not shape checkpointed state (an address, a
timeout): left out of the state's fingerprint, so a run may resume with another value
(``field(default=..., metadata=RUN_ONLY)``)."""


def shapes_state(f: dataclasses.Field) -> bool:
    """Whether the option field ``f`` enters the fingerprint of checkpointed state."""
    return f.metadata.get("shapes_state", True)


@lru_cache(maxsize=None)
def _field_docstrings(cls: type) -> Dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _dest_of(cls: type, f: dataclasses.Field) -> str:
    return flag_of(cls, f.name)[2:].replace("-", "_")


def flag_of(cls: type, name: str) -> str:
    """The command-line flag of field ``name`` of config class ``cls``."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    meta = f.metadata.get("argparse", {})
    if meta.get("flag"):
        return meta["flag"]
    prefix = getattr(cls, "ARG_PREFIX", "")
    stem = name.replace("_", "-")
    return f"--{prefix}-{stem}" if prefix else f"--{stem}"


def _resolved_type(cls: type, f: dataclasses.Field) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[f.name]


def _unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


_FIELD_DEFAULT = object()


def add_config_args(
    parser: argparse.ArgumentParser, cls: type, *, flag_default: Any = _FIELD_DEFAULT
) -> argparse.ArgumentParser:
    """Add one argument group with a flag per field of ``cls``; returns ``parser``.

    Args:
        parser: the parser.
        cls: a config dataclass.
        flag_default: the argparse default of every flag instead of the field defaults
            (e.g. ``argparse.SUPPRESS``, to tell given flags from defaults).
    """
    group = parser.add_argument_group(title=getattr(cls, "ARG_GROUP", cls.__name__))
    docs = _field_docstrings(cls)
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        meta = f.metadata.get("argparse", {})
        flag = flag_of(cls, f.name)
        dest = _dest_of(cls, f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        # argparse %-formats help strings.
        help_text = docs.get(f.name, "").replace("%", "%%")
        tp, _ = _unwrap_optional(_resolved_type(cls, f))
        override = {} if flag_default is _FIELD_DEFAULT else {"default": flag_default}
        if tp is bool:
            if default:
                neg = "--no-" + flag[2:]
                group.add_argument(
                    neg, dest=dest, action="store_false", help=f"Disable: {help_text}", **override
                )
            else:
                group.add_argument(
                    flag,
                    *meta.get("aliases", ()),
                    dest=dest,
                    action="store_true",
                    help=help_text,
                    **override,
                )
            continue
        kwargs: Dict[str, Any] = {"dest": dest, "default": default}
        if typing.get_origin(tp) in (list, tuple, List, Tuple):
            inner, *_ = typing.get_args(tp) or (str,)
            kwargs["type"] = inner
            kwargs["nargs"] = meta.get("nargs") or "+"
            if isinstance(default, tuple):
                kwargs["default"] = list(default)
        else:
            kwargs["type"] = tp
        if meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
            help_text = f"{help_text} Choices: {', '.join(map(str, meta['choices']))}."
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if default is not None and tp is not bool:
            help_text = f"{help_text} Default: {default}."
        kwargs.update(override)
        group.add_argument(flag, *meta.get("aliases", ()), help=help_text, **kwargs)
    return parser


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build config ``cls`` from parsed ``args`` (fields missing on ``args`` keep defaults)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        dest = _dest_of(cls, f)
        if hasattr(args, dest):
            value = getattr(args, dest)
            tp, _ = _unwrap_optional(_resolved_type(cls, f))
            if typing.get_origin(tp) is tuple and isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def check_choice(cls: type, name: str, value: Any) -> None:
    """Raise :class:`ConfigError` naming the flag unless ``value`` is one of the field's
    ``arg(choices=...)`` (strings)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    choices = f.metadata.get("argparse", {}).get("choices")
    if choices and value not in choices:
        raise ConfigError(
            flag_of(cls, name), f"invalid value {value!r} (choose from {', '.join(choices)})"
        )


def check_positive(cls: type, name: str, value: Any, *, allow_zero: bool = False) -> None:
    """Raise :class:`ConfigError` naming the flag unless ``value`` is > 0 (or >= 0) and, for
    a float, finite (NaN passes ``value < 0`` unnoticed)."""
    if value is None:
        return
    finite = not isinstance(value, float) or math.isfinite(value)
    if not finite or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "a finite number " if isinstance(value, float) else ""
        raise ConfigError(flag_of(cls, name), f"must be {kind}{bound}, got {value!r}")
