"""What a user's function or object accepts and implements, read from its signature and its class.

The loops, the engine and the hook table ask these questions: "does ``obj``
implement hook X itself" (:func:`overrides`), "can ``fn`` take argument X"
(:func:`takes_argument`, :func:`names_parameter`) and "how is this step
method called with ``(batch, batch_idx)``" (:func:`step_call`). They are
answered here and nowhere else. This module imports nothing of jaxlight but
its errors, so the engine (below the hook dispatch in :mod:`jaxlight.hooks`)
can read step signatures.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from jaxlight.errors import MisconfigurationError


def overrides(obj: Any, name: str) -> bool:
    """Whether ``obj`` implements ``name`` itself rather than inheriting the default.

    The default is the definition in the most basic class of ``obj``'s type
    that defines ``name`` (``Callback``'s no-op for callbacks, ``ModelHooks``'
    or ``LightningModule``'s for modules); an attribute set on the instance
    (``model.validation_step = fn``, ``LambdaCallback``) counts as an
    implementation. False when nothing defines ``name``.
    """
    if name in getattr(obj, "__dict__", {}):
        return True
    impl = getattr(type(obj), name, None)
    if impl is None:
        return False
    root = next((c for c in reversed(type(obj).__mro__) if name in vars(c)), None)
    return root is None or impl is not getattr(root, name)  # None: provided outside the class bodies


def parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    """``fn``'s parameters (a bound method's without ``self``); None when Python cannot read its signature."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def takes_argument(fn: Callable[..., Any], name: str, position: int) -> bool | None:
    """Whether ``fn`` accepts argument ``name`` passed as positional argument ``position`` (0-based).

    True when a parameter is called ``name``, when ``fn`` takes ``*args``, or
    when it has more than ``position`` positional parameters (Lightning passes
    ``dataloader_idx`` positionally, whatever the parameter is called). None
    when the signature cannot be read: the caller decides what unknown means.
    """
    ps = parameters(fn)
    if ps is None:
        return None
    if any(p.name == name or p.kind is p.VAR_POSITIONAL for p in ps):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in ps) > position


def names_parameter(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` has a parameter called ``name`` (so it can be passed by keyword)."""
    return any(p.name == name for p in parameters(fn) or ())


STEP_FORMS = "(self, batch), (self, batch, batch_idx) or (self, batch, batch_idx, dataloader_idx)"


def step_call(
    fn: Callable[..., Any], where: str, dataloader_idx: int | None = None
) -> Callable[[Any, Any], Any] | None:
    """How to call a step method ``fn`` (bound) with ``(batch, batch_idx)`` as Lightning would call it.

    Lightning passes ``batch_idx`` when the method takes it (a parameter of that name, ``*args``, or a
    second positional parameter) and ``dataloader_idx`` with several loaders when it takes that (by name
    as a keyword, else third positionally); a required third positional parameter gets ``0`` with one
    loader. Returns None when ``fn(batch, batch_idx)`` is already right, else the adapter. Any other
    signature (no parameter for the batch, more required parameters, a required keyword-only one) raises
    a :class:`MisconfigurationError` naming ``where`` and the signature. An unreadable signature (a
    builtin) is called with ``(batch, batch_idx)``.
    """
    ps = parameters(fn)
    if ps is None:
        return None
    positional = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in ps)
    required = [p for p in positional if p.default is p.empty]
    kw_required = [p.name for p in ps if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    sig = f"{where}{inspect.signature(fn)}"
    if not positional and not varargs:
        raise MisconfigurationError(f"{sig} takes no batch; write it as {STEP_FORMS}")
    if any(p.name == "optimizer_idx" for p in ps):
        raise MisconfigurationError(
            f"{sig} takes optimizer_idx, which Lightning 2 no longer passes: with several optimizers use manual "
            f"optimization (self.automatic_optimization = False, then self.optimizers() in the step)"
        )
    if kw_required and kw_required != ["dataloader_idx"]:
        raise MisconfigurationError(
            f"{sig} has required keyword-only parameters {kw_required} that Lightning never passes; write it as "
            f"{STEP_FORMS}"
        )
    if len(required) > 3:
        raise MisconfigurationError(
            f"{sig} requires {len(required)} arguments but a step gets at most 3 (batch, batch_idx, "
            f"dataloader_idx); write it as {STEP_FORMS}, or give the others defaults"
        )
    with_idx = varargs or len(positional) >= 2 or any(p.name == "batch_idx" for p in positional)
    if dataloader_idx is None and (len(required) == 3 or kw_required):
        dataloader_idx = 0  # one loader: Lightning's default index for a step that requires one
    by_name = any(p.name == "dataloader_idx" and p.kind is not p.POSITIONAL_ONLY for p in ps)
    takes_dl = varargs or len(positional) >= 3 or by_name
    if dataloader_idx is None or not takes_dl:
        if with_idx:
            return None
        return lambda batch, batch_idx: fn(batch)
    if by_name:
        if with_idx:
            return lambda batch, batch_idx: fn(batch, batch_idx, dataloader_idx=dataloader_idx)
        return lambda batch, batch_idx: fn(batch, dataloader_idx=dataloader_idx)
    # Lightning passes it as the third positional argument, whatever its name
    return lambda batch, batch_idx: fn(batch, batch_idx, dataloader_idx)


__all__ = ["STEP_FORMS", "names_parameter", "overrides", "parameters", "step_call", "takes_argument"]
