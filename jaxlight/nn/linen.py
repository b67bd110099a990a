"""Flax Linen models as NNX modules the trainer can train, called as their Linen code expects.

``from_linen`` returns a :class:`LinenModule`: flax's ``nnx.bridge.ToNNX``
plus what training needs. It follows NNX's ``train()`` / ``eval()`` (the
trainer's steps), so the step code never threads Linen's ``mutable=`` or
``rngs=``:

- training: every non-parameter collection the model created at init
  (``batch_stats``...) is mutable, and its updates are written into the
  wrapper's variables, which the trainer carries in ``TrainState.model_state``;
- evaluation: every collection is read-only;
- always: one key per RNG stream is drawn from the wrapper's ``nnx.Rngs``
  and passed as Linen's ``rngs=``, so dropout sees a new mask every step;
- a ``train`` / ``deterministic`` argument of the model's method that a call
  leaves out is filled from the mode.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen as nn
from flax import nnx
from flax.core import meta
from flax.errors import ModifyScopeVariableError
from flax.nnx import traversals, variablelib
from flax.nnx.bridge import ToNNX
from flax.nnx.bridge import variables as bridge_vars

TRAIN_ARGS: tuple[str, ...] = ("train", "training", "is_training")
"""Argument names filled with True in training steps and False in evaluation."""

EVAL_ARGS: tuple[str, ...] = ("deterministic", "use_running_average", "inference", "eval")
"""Argument names filled with False in training steps and True in evaluation."""


def make_rngs(rngs: Any) -> nnx.Rngs:
    """The ``nnx.Rngs`` an adapter owns, from what the user passed.

    An int seed or a key gives one ``default`` stream, a mapping gives one
    stream per name (``{"params": 0, "dropout": 1}``); the n-th key a stream
    hands out is ``jax.random.fold_in(jax.random.key(seed), n)`` (nnx.Rngs'
    rule). An ``nnx.Rngs`` object is forked, as NNX layers do, so the adapter
    never shares RNG variables with other modules.
    """
    if rngs is None:
        return nnx.Rngs(0)
    if isinstance(rngs, nnx.Rngs):
        return rngs.fork()
    if isinstance(rngs, Mapping):
        if not rngs:
            raise ValueError("rngs is an empty mapping; give at least one stream, e.g. {'params': 0, 'dropout': 1}")
        return nnx.Rngs(**dict(rngs))
    if isinstance(rngs, (int, jax.Array)) and not isinstance(rngs, bool):
        return nnx.Rngs(rngs)
    raise TypeError(
        f"rngs must be an int seed, a jax key, a {{stream: seed}} mapping or an nnx.Rngs, got {type(rngs).__name__}"
    )


def mode_arguments(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any], training: bool) -> dict[str, bool]:
    """The train/deterministic-style arguments of ``fn`` that this call leaves out, with their values.

    ``fn`` is the unbound method (its first parameter is ``self``); a name in
    :data:`TRAIN_ARGS` gets ``training``, one in :data:`EVAL_ARGS` gets
    ``not training``. An argument given positionally or by keyword is never
    touched.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and the like: nothing to fill
        return {}
    wanted = [n for n in sig.parameters if n in TRAIN_ARGS or n in EVAL_ARGS]
    if not wanted:
        return {}
    try:
        bound = sig.bind_partial(None, *args, **kwargs).arguments
    except TypeError:  # a wrong call: let the model raise its own error
        return {}
    return {n: (training if n in TRAIN_ARGS else not training) for n in wanted if n not in bound}


class LinenModule(ToNNX):
    """A flax Linen module held as NNX variables, trainable by the trainer as it is.

    Parameter paths are Linen's (``Conv_0/kernel``, ``BatchNorm_0/mean``) and
    ``nn.with_logical_partitioning`` names are kept as each parameter's
    ``out_sharding``, so placement follows them. ``deterministic`` is the mode
    flag ``nnx.Module.train()`` / ``eval()`` set (False: training).

    Calling the wrapper calls the Linen module's ``apply`` (or ``method=``):
    in training the non-parameter collections created at init are mutable
    and their new values stored; in evaluation all are read-only. An explicit
    ``mutable=`` or ``rngs=`` overrides the mode's choice for that call (the
    call still returns only the output, as ``nnx.bridge.ToNNX`` does).
    """

    def __init__(self, module: nn.Module, rngs: Any = None, *, mode_arg: bool = True) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"from_linen expects a flax.linen.Module instance, got {type(module).__name__}")
        super().__init__(module, rngs=None)
        self.to_nnx__rngs = nnx.data(make_rngs(rngs))  # ToNNX would fork it again
        self.to_nnx__mode_arg = bool(mode_arg)
        self.deterministic = False

    # -------------------------------------------------------------- variables
    def _linen_attrs(self) -> dict[str, Any]:
        return {
            k: v for k, v in vars(self).items() if not k.startswith(("to_nnx__", "_pytree__")) and k != "deterministic"
        }

    def _flat_variables(self) -> dict[tuple, nnx.Variable]:
        """``{(collection, *path): variable}`` for every Linen variable held."""
        out = {}
        for path, var in traversals.flatten_mapping(self._linen_attrs()).items():
            if isinstance(var, nnx.Variable):
                out[(variablelib.variable_name_from_type(type(var)), *path)] = var
        return out

    def linen_variables(self) -> dict[str, Any]:
        """The model's variables as Linen's ``{"params": ..., "batch_stats": ...}`` dict of arrays
        (for calling ``module.apply`` by hand)."""
        return traversals.unflatten_mapping({k: v.get_value() for k, v in self._flat_variables().items()})

    def _store_init(self, variables: Mapping[str, Any]) -> None:
        # Eager sharding off: annotated parameters are placed by the trainer's rules, not by flax.
        with nnx.use_eager_sharding(False):
            attrs = bridge_vars.linen_vars_to_nnx_attrs(variables)
        for name, value in attrs.items():
            if name == "deterministic" or name.startswith(("to_nnx__", "_pytree__")):
                raise ValueError(f"the Linen model has a top-level variable or submodule named {name!r}; rename it")
            setattr(self, name, value)

    def _write_updates(self, updates: Mapping[str, Any]) -> None:
        held = self._flat_variables()
        new = []
        for key, value in traversals.flatten_mapping(dict(updates)).items():
            if isinstance(value, meta.AxisMetadata):
                value = value.unbox()
            var = held.get(key)
            if var is None:
                new.append("/".join(map(str, key)))
            else:
                var.set_value(value)
        if new:
            raise ValueError(
                f"the Linen model {type(self.to_nnx__module).__name__} created variables that init did not create: "
                f"{new}. A wrapped model's variables are fixed when it is initialised (they are the train state); "
                f"initialise it with arguments that create them, or call module.apply(self.net.linen_variables(), "
                f"..., mutable=...) yourself to read such collections (e.g. sown intermediates)."
            )

    # -------------------------------------------------------------- calling
    def _draw_rngs(self, rngs: Any, init: bool) -> dict[str, jax.Array]:
        """Linen's ``rngs=`` for one call: the next key of each stream (a call's own ``rngs=`` wins)."""
        if isinstance(rngs, Mapping):
            return dict(rngs)
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            return {"params": rngs}
        streams = dict((self.to_nnx__rngs if rngs is None else rngs).items())
        if "params" not in streams and "default" in streams:
            streams["params"] = streams.pop("default")
        if init:
            return {"params": streams["params"]()} if "params" in streams else {}
        # Every stream but params; a lone stream goes as "params", which Linen uses for any name (dropout...).
        others = {k: s for k, s in streams.items() if k != "params"}
        return {name: stream() for name, stream in (others or streams).items()}

    def _method_fn(self, method: Callable[..., Any] | str | None) -> Callable[..., Any]:
        if method is None:
            return type(self.to_nnx__module).__call__
        if isinstance(method, str):
            return getattr(type(self.to_nnx__module), method)
        return method

    def __call__(
        self,
        *args: Any,
        rngs: Any = None,
        method: Callable[..., Any] | str | None = None,
        mutable: Any = None,
        **kwargs: Any,
    ) -> Any:
        module = self.to_nnx__module
        init = self._pytree__state.initializing
        training = not init and not self.deterministic
        if self.to_nnx__mode_arg:
            kwargs = {**kwargs, **mode_arguments(self._method_fn(method), args, kwargs, training)}
        linen_rngs = self._draw_rngs(rngs, init)
        if init:
            out, variables = module.init_with_output(linen_rngs, *args, method=method, **kwargs)
            self._store_init(variables)
            return out
        held = self._flat_variables()
        variables = traversals.unflatten_mapping({k: v.get_value() for k, v in held.items()})
        if mutable is None:
            carried = sorted({k[0] for k in held} - {"params"})
            mutable = carried if training and carried else False
        try:
            res = module.apply(variables, *args, rngs=linen_rngs, method=method, mutable=mutable, **kwargs)
        except ModifyScopeVariableError as e:
            if not self.deterministic:
                raise
            raise RuntimeError(
                f"{type(module).__name__} tried to update a variable in evaluation mode, where Linen collections "
                f"are read-only. The call most likely passed train=True (or deterministic=False) in a validation, "
                f"test or predict step; leave that argument out and from_linen fills it from the trainer's mode."
            ) from e
        if mutable is False:
            return res
        out, updates = res
        self._write_updates(updates)
        return out


def from_linen(
    module: nn.Module,
    *sample_inputs: Any,
    rngs: Any = None,
    mode_arg: bool = True,
    **init_kwargs: Any,
) -> LinenModule:
    """Wrap a flax Linen module as an NNX module the trainer trains as it is.

    Initialises like ``module.init({"params": key}, *sample_inputs,
    **init_kwargs)``, with ``key`` the next key of the ``params`` stream of
    ``rngs`` (see :func:`make_rngs`; default seed 0). When the model's method
    has a ``train``-style argument (:data:`TRAIN_ARGS`, :data:`EVAL_ARGS`)
    that ``init_kwargs`` leave out, init runs with it in evaluation mode
    (``train=False``), as Linen examples do.

    Call it in ``configure_model`` and call the result as the Linen code
    expects, ``self.net(x)`` or ``self.net(x, train=True)``:

    - in ``training_step``, collections other than ``params``
      (``batch_stats``...) are mutable and their updates carried in the train
      state; in validation/test/predict steps they are read-only;
    - each call passes ``rngs={stream: next key}`` for the streams of
      ``rngs`` other than ``params`` (a single seed is passed as ``params``,
      which Linen uses for ``dropout`` too), advancing them every step;
    - with ``mode_arg`` (default), an omitted ``train``/``deterministic``
      argument is filled from the mode; an explicit one is kept.

    Parameters are trained (``nnx.Param``, Linen's paths, logical axes from
    ``nn.with_logical_partitioning`` kept for placement); other collections
    are carried. See docs/models.md.
    """
    return LinenModule(module, rngs=rngs, mode_arg=mode_arg).lazy_init(*sample_inputs, **init_kwargs)
