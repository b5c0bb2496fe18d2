"""What a checkpoint's hyperparameters may do to a run's configuration: fill in arguments of the configured
model class, never choose a class.

Lightning's command line merges the ``hyper_parameters`` of a ``--ckpt_path`` file into the configuration, where
a ``class_path`` (``_class_path``) would replace the configured model, import the module it names and run its
import-time code, and a nested ``class_path``, or a dotted name given to a callable argument, would do the same
for an argument. :func:`check_hyperparameters` lets through only plain values (numbers, strings, lists and dicts of
them) for arguments of the configured class whose type takes plain values; an argument that takes a class or a
callable, and any nested ``class_path``, must equal the configuration's.
"""

from __future__ import annotations

import inspect
import os
import types
import typing
from pathlib import PurePath
from typing import Any

_PLAIN_TYPES = (type(None), bool, int, float, str, PurePath, os.PathLike)
_CLASS_KEYS = ("class_path", "_class_path")


class CheckpointHyperparametersError(ValueError):
    """The hyperparameters of a checkpoint would choose a class or set what the configured class does not take."""


def _plain_value(value: Any, depth: int = 0) -> bool:
    """Numbers, strings and lists and dicts of them, without a ``class_path``; bounded depth."""
    if depth > 32:
        return False
    if type(value) in (type(None), bool, int, float, str):
        return True
    if type(value) in (list, tuple):
        return all(_plain_value(v, depth + 1) for v in value)
    if type(value) is dict:
        return not any(k in value for k in _CLASS_KEYS) and all(
            type(k) is str and _plain_value(v, depth + 1) for k, v in value.items()
        )
    return False


def _plain_annotation(annotation: Any) -> bool:
    """Whether an argument of this type takes only plain values (no class, no callable named by a string)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return True
    if isinstance(annotation, type):
        return issubclass(annotation, _PLAIN_TYPES) or annotation in (list, dict, tuple)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return True
    if origin in (typing.Union, types.UnionType, list, dict, tuple):
        return all(a is Ellipsis or _plain_annotation(a) for a in typing.get_args(annotation))
    return False


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors and other values without a plain equality
        return False


def _parameters(cls: type) -> tuple[dict[str, Any], bool]:
    """The named parameters of ``cls``'s constructor with their types, and whether it takes ``**kwargs``."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not resolve: judged by the value alone
        hints = {}
    signature = inspect.signature(cls.__init__)
    named = {
        name: hints.get(name, inspect.Parameter.empty)
        for name, p in signature.parameters.items()
        if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return named, any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())


def check_hyperparameters(
    hparams: dict[str, Any], cls: type, class_names: set[str], configured: dict[str, Any], path: str
) -> dict[str, Any]:
    """The hyperparameters of the checkpoint ``path`` that may fill in arguments of the configured class ``cls``.

    Args:
        hparams: The checkpoint's ``hyper_parameters`` (without Lightning's ``_instantiator``).
        cls: The model class the configuration names.
        class_names: The names that stand for ``cls`` (the configuration's ``class_path``, its module and name).
        configured: The configuration's arguments of ``cls`` (plain values; nested classes as dicts).
        path: The checkpoint, for messages.

    Returns:
        The arguments of ``cls`` that ``hparams`` sets to other values than the configuration.

    Raises:
        CheckpointHyperparametersError: If the checkpoint names another class, an argument ``cls`` does not take,
            or a value that is not plain for an argument whose configured value differs.
    """
    hparams = dict(hparams)
    for key in _CLASS_KEYS:
        named = hparams.pop(key, None)
        if named is not None and named not in class_names:
            shown = named if type(named) is str and len(named) <= 200 else f"a {type(named).__name__}"
            raise CheckpointHyperparametersError(
                f"ckpt_path={path!r} was saved by the model class {shown}; this run configures "
                f"{sorted(class_names)[0]}. A checkpoint's hyperparameters fill in arguments of the configured "
                "class only: configure the model class the checkpoint was saved with (--model CLASS), or resume "
                "from a checkpoint of this one."
            )
    parameters, takes_kwargs = _parameters(cls)
    hparams = {k: v for k, v in hparams.items() if not _equal(v, configured.get(k, inspect.Parameter.empty))}
    for key, value in hparams.items():
        if type(key) is not str or (key not in parameters and not takes_kwargs):
            raise CheckpointHyperparametersError(
                f"ckpt_path={path!r} holds the hyperparameter {str(key)[:100]!r}, which {cls.__name__} does not "
                "take. Resume from a checkpoint of this model class."
            )
        plain = _plain_annotation(parameters.get(key, inspect.Parameter.empty)) and _plain_value(value)
        if not plain:
            raise CheckpointHyperparametersError(
                f"ckpt_path={path!r} sets {cls.__name__}'s argument {key!r} to a class, callable or other value "
                "that is not plain data, which differs from the configuration: a checkpoint does not choose classes "
                f"or code. Set {key} in the configuration (--model.{key} ...) instead."
            )
    return hparams
