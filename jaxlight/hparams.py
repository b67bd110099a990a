"""Hyperparameter capture for ``save_hyperparameters`` (Lightning semantics)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``hparams.lr == hparams["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(f"no hyperparameter {key!r}; saved: {sorted(self)}") from e

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        del self[key]


def collect_init_args(frame: Any, ignore: Sequence[str] = ()) -> dict[str, Any]:
    """The arguments of the ``__init__`` running in ``frame`` (and of the
    subclass ``__init__`` frames above it that share ``self``)."""
    args: dict[str, Any] = {}
    self_obj = frame.f_locals.get("self")
    chain = []
    f = frame
    while f is not None and f.f_code.co_name == "__init__" and f.f_locals.get("self") is self_obj:
        chain.append(f)
        f = f.f_back
    for f in chain:  # from the frame that called save_hyperparameters out: the most derived class wins
        info = inspect.getargvalues(f)
        for name in info.args:
            if name == "self":
                continue
            args[name] = f.f_locals[name]
        if info.varargs and f.f_locals.get(info.varargs):
            args[info.varargs] = f.f_locals[info.varargs]
        if info.keywords:
            args.update(f.f_locals.get(info.keywords, {}))
    for name in list(args):
        if name in ignore or name.startswith("__"):
            args.pop(name)
    return args


def select(args: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    missing = [n for n in names if n not in args]
    if missing:
        raise ValueError(f"save_hyperparameters: {missing} are not arguments of __init__ (have {sorted(args)})")
    return {n: args[n] for n in names}


class HyperparametersMixin:
    """``save_hyperparameters`` and ``hparams``, shared by LightningModule and LightningDataModule (Lightning's
    mixin of the same name): the recorded values are logged at fit start and saved in checkpoints."""

    def save_hyperparameters(
        self, *args: Any, ignore: Sequence[str] | str | None = None, frame: Any = None, logger: bool = True
    ) -> None:
        """Store ``__init__`` arguments in ``self.hparams`` (and the checkpoint).

        With no arguments every init argument is saved; names select some; a
        dict is saved as given. ``ignore`` drops names (e.g. modules).
        """
        ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
        if len(args) == 1 and isinstance(args[0], Mapping):
            hp = dict(args[0])
        else:
            if frame is None:
                frame = inspect.currentframe().f_back  # type: ignore[union-attr]
            init_args = collect_init_args(frame, ignore)
            hp = select(init_args, args) if args else init_args
        self._hparams = AttributeDict(hp)
        self._hparams_initial = AttributeDict(dict(hp))
        self._log_hyperparams = logger

    @property
    def hparams(self) -> AttributeDict:
        return self.__dict__.get("_hparams", AttributeDict())

    @property
    def hparams_initial(self) -> AttributeDict:
        return self.__dict__.get("_hparams_initial", AttributeDict())
