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
  leaves out is filled from the mode;
- a boolean ``deterministic`` / ``train`` / ``training`` / ``is_training``
  field of the module, or of a dataclass it holds as a field (lm1b's
  ``config.deterministic``), is set to its evaluation value in a clone that
  validation, test and predict steps call (``eval_module=`` overrides it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
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


MODE_FIELDS: tuple[str, ...] = ("deterministic", "train", "training", "is_training")
"""Boolean module (or config-dataclass) fields read as a mode switch: ``deterministic`` is True in
evaluation, the others are False in evaluation."""


def _eval_value(name: str) -> bool:
    return name not in TRAIN_ARGS


def mode_fields(module: Any) -> list[str]:
    """The mode switches :func:`eval_clone` sets, as dotted paths (``"deterministic"``,
    ``"config.deterministic"``): boolean :data:`MODE_FIELDS` of the module's dataclass fields, and of
    dataclasses (not modules) it holds as fields, one level down (lm1b's ``TransformerConfig``)."""
    found: list[str] = []
    if not dataclasses.is_dataclass(module):
        return found
    for f in dataclasses.fields(module):
        if f.name in ("parent", "name"):
            continue
        value = getattr(module, f.name, None)
        if f.name in MODE_FIELDS and type(value) is bool:
            found.append(f.name)
        elif (
            dataclasses.is_dataclass(value)
            and not isinstance(value, type)
            and not isinstance(value, nn.Module)
            and f.name not in MODE_FIELDS
        ):
            for g in dataclasses.fields(value):
                if g.name in MODE_FIELDS and type(getattr(value, g.name, None)) is bool:
                    found.append(f"{f.name}.{g.name}")
    return found


def eval_clone(module: nn.Module) -> nn.Module:
    """``module`` with every :func:`mode_fields` switch at its evaluation value (``deterministic=True``,
    ``train=False``...): a clone, or ``module`` itself when there is nothing to switch or every switch
    already has that value. A config dataclass field is replaced with ``dataclasses.replace``."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, bool]] = {}
    for path in mode_fields(module):
        head, _, leaf = path.partition(".")
        if leaf:
            if getattr(getattr(module, head), leaf) != _eval_value(leaf):
                nested.setdefault(head, {})[leaf] = _eval_value(leaf)
        elif getattr(module, head) != _eval_value(head):
            top[head] = _eval_value(head)
    for head, changes in nested.items():
        top[head] = dataclasses.replace(getattr(module, head), **changes)
    return module.clone(**top) if top else module


#: Linen layers whose ``dtype`` parametrises a weight (a power iteration, a norm of the kernel), not the
#: activations' compute: they keep flax's default.
_WEIGHT_REPARAMETRISATIONS = (nn.SpectralNorm, nn.WeightNorm)


def follows_policy(module: nn.Module) -> bool:
    """Whether ``module`` is a flax Linen layer (``Dense``, ``Conv``, ``Embed``, the norms, attention...) that
    leaves its compute ``dtype`` to flax (None). Users' own modules are never touched."""
    return (
        type(module).__module__.startswith("flax.")
        and getattr(module, "dtype", 0) is None
        and hasattr(module, "param_dtype")
        and not isinstance(module, _WEIGHT_REPARAMETRISATIONS)
    )


@contextlib.contextmanager
def compute_in(dtype: Any) -> Iterator[None]:
    """Inside, every flax Linen layer that :func:`follows_policy` and is called computes in ``dtype``, as if
    built with ``dtype=dtype`` (None: nothing changes).

    The layer objects a call sees are the bound clones ``apply`` makes, never the user's module, so the
    dtype is set on them for the call (``nn.intercept_methods``) and they are discarded after ``apply``.
    """
    if dtype is None:
        yield
        return

    def interceptor(next_fun: Callable[..., Any], args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        if context.method_name != "setup" and follows_policy(module):
            object.__setattr__(module, "dtype", dtype)  # a frozen dataclass field of a bound clone
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        yield


def _tracing() -> bool:
    """Whether this runs inside a jax trace (jit, eval_shape): an op on constants gives a tracer there."""
    return isinstance(jax.lax.add(np.float32(0), np.float32(0)), jax.core.Tracer)


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

    Evaluation calls (and init) use ``eval_module``: by default
    :func:`eval_clone` of the module (its ``deterministic`` / ``train``-style
    fields, or a held config's, at their evaluation values). ``train_kwargs``
    / ``eval_kwargs`` are keyword arguments added to every call in that mode
    (a call's own keywords win).
    """

    def __init__(
        self,
        module: nn.Module,
        rngs: Any = None,
        *,
        mode_arg: bool = True,
        eval_module: nn.Module | Callable[[nn.Module], nn.Module] | None = None,
        train_kwargs: Mapping[str, Any] | None = None,
        eval_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"from_linen expects a flax.linen.Module instance, got {type(module).__name__}")
        super().__init__(module, rngs=None)
        self.to_nnx__rngs = nnx.data(make_rngs(rngs))  # ToNNX would fork it again
        self.to_nnx__mode_arg = bool(mode_arg)
        if eval_module is None:
            evaluation = eval_clone(module)
        elif isinstance(eval_module, nn.Module):
            evaluation = eval_module
        elif callable(eval_module):
            evaluation = eval_module(module)
        else:
            raise TypeError(f"eval_module must be a Linen module or a callable, got {type(eval_module).__name__}")
        if not isinstance(evaluation, nn.Module):
            raise TypeError(f"eval_module(module) returned {type(evaluation).__name__}, not a Linen module")
        self.to_nnx__eval_module = evaluation
        # tuples of pairs: static attributes of the NNX graph must be hashable
        self.to_nnx__train_kwargs = tuple(dict(train_kwargs or {}).items())
        self.to_nnx__eval_kwargs = tuple(dict(eval_kwargs or {}).items())
        self.to_nnx__compute_dtype = None  # set by the trainer's precision (Precision.bind) in its steps
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

    _jaxlight_linen_layout = True  # load_variables: sources in Linen's {"params": ..., "batch_stats": ...} layout

    def _jaxlight_loadable_variables(self) -> dict[str, nnx.Variable]:
        return {"/".join(map(str, k)): v for k, v in self._flat_variables().items()}

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

    def _jaxlight_compute_dtype(self, dtype: Any) -> None:
        """``Precision.bind``: inside this step, flax Linen layers that leave their ``dtype`` to flax
        compute in ``dtype`` (:func:`compute_in`)."""
        self.to_nnx__compute_dtype = dtype

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

    def linen_module(self, training: bool | None = None) -> nn.Module:
        """The Linen module calls use in training (``training=True``) or evaluation (False); None: the
        current mode (``deterministic``)."""
        training = not self.deterministic if training is None else training
        return self.to_nnx__module if training else self.to_nnx__eval_module

    def _call_kwargs(self, method: Any, args: tuple, kwargs: Mapping[str, Any], training: bool) -> dict[str, Any]:
        extra = dict(self.to_nnx__train_kwargs if training else self.to_nnx__eval_kwargs)
        kwargs = {**extra, **kwargs}
        if self.to_nnx__mode_arg:
            kwargs = {**kwargs, **mode_arguments(self._method_fn(method), args, kwargs, training)}
        return kwargs

    def _init_from(self, source: Any, args: tuple, kwargs: Mapping[str, Any], rngs: Any, strict: bool) -> None:
        """Create the variables from existing values instead of running init (shapes from ``jax.eval_shape``)."""
        from jaxlight.nn.variables import VariablesMismatchError, check_keys, read_source

        if _tracing():
            raise RuntimeError(
                "from_linen(..., variables=...) was called inside a jax trace (configure_model runs under "
                "jax.eval_shape and jit), where loaded values could only become constants of the program. "
                "Build the wrapper in the LightningModule's __init__ (the trainer then places each loaded leaf "
                "on its sharding), or keep from_linen without variables= in configure_model and call "
                "jl.nn.load_variables(self.net, source) in on_fit_start"
            )
        module = self.to_nnx__eval_module
        kwargs = self._call_kwargs(None, args, kwargs, training=False)
        linen_rngs = self._draw_rngs(rngs, True)
        abstract = jax.eval_shape(lambda r: module.init(r, *args, **kwargs), linen_rngs)
        flat = traversals.flatten_mapping(dict(abstract))
        unboxed = {k: v.unbox() if isinstance(v, meta.AxisMetadata) else v for k, v in flat.items()}
        shapes = {"/".join(map(str, k)): tuple(v.shape) for k, v in unboxed.items()}
        values = read_source(source, linen_collections={k[0] for k in flat})
        missing, unexpected, mismatched = check_keys(shapes, {k: tuple(np.shape(v)) for k, v in values.items()})
        if mismatched or (strict and (missing or unexpected)):
            raise VariablesMismatchError.build(type(module).__name__, missing, unexpected, mismatched, strict)
        initial = None
        if missing:  # strict=False: the ones the source lacks keep their init values
            initial = traversals.flatten_mapping(dict(module.init(linen_rngs, *args, **kwargs)))
        tree = {}
        for key, leaf in flat.items():
            name = "/".join(map(str, key))
            if name in values:
                value = np.asarray(values[name], dtype=unboxed[key].dtype)
                tree[key] = leaf.replace_boxed(value) if isinstance(leaf, meta.AxisMetadata) else value
            else:
                tree[key] = initial[key]
        self._store_init(traversals.unflatten_mapping(tree))

    def __call__(
        self,
        *args: Any,
        rngs: Any = None,
        method: Callable[..., Any] | str | None = None,
        mutable: Any = None,
        **kwargs: Any,
    ) -> Any:
        init = self._pytree__state.initializing
        training = not init and not self.deterministic
        module = self.linen_module(training)
        kwargs = self._call_kwargs(method, args, kwargs, training)
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
            with compute_in(self.to_nnx__compute_dtype):
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
    init_key: Any = None,
    variables: Any = None,
    strict: bool = True,
    eval_module: nn.Module | Callable[[nn.Module], nn.Module] | None = None,
    train_kwargs: Mapping[str, Any] | None = None,
    eval_kwargs: Mapping[str, Any] | None = None,
    **init_kwargs: Any,
) -> LinenModule:
    """Wrap a flax Linen module as an NNX module the trainer trains as it is.

    Initialises like ``module.init({"params": key}, *sample_inputs,
    **init_kwargs)``, with ``key`` the next key of the ``params`` stream of
    ``rngs`` (see :func:`make_rngs`; default seed 0), or ``init_key`` itself
    when given: ``init_key=k`` runs exactly ``module.init(k, ...)`` (a
    mapping ``{"params": k1, "dropout": k2}`` is passed as Linen's rngs as
    is), so an example's own key reproduces its own initial parameters.
    When the model's method has a ``train``-style argument (:data:`TRAIN_ARGS`,
    :data:`EVAL_ARGS`) that ``init_kwargs`` leave out, init runs with it in
    evaluation mode (``train=False``), as Linen examples do; init also calls
    the evaluation module (below), as lm1b initialises with its eval config.

    ``variables``: existing values instead of an init (see
    :func:`jaxlight.nn.load_variables` for the sources: a Linen variables
    dict such as ``{"params": ..., "batch_stats": ...}`` or its ``params``
    alone, a flax msgpack file, an orbax checkpoint directory). Keys and
    shapes are checked against what init would create before anything is
    read; one error lists every missing, unexpected and mis-shaped key
    (``strict=False`` lets missing ones keep their init values and ignores
    unexpected ones). Call it outside a trace (in ``__init__``): the arrays
    stay on the host and the trainer places each onto its sharding.

    Mode switches: evaluation (validate/test/predict) calls ``eval_module``,
    by default :func:`eval_clone` of ``module`` (boolean ``deterministic`` /
    ``train`` / ``training`` / ``is_training`` fields, on the module or a
    dataclass it holds, at their evaluation values); pass a Linen module, or a
    callable ``module -> module``, to choose it yourself (``eval_module=module``
    keeps dropout on in evaluation). ``train_kwargs`` / ``eval_kwargs`` are
    keyword arguments every call of that mode gets (``eval_kwargs={"is_train":
    False}`` for a flag with another name).

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
    net = LinenModule(
        module,
        rngs=rngs,
        mode_arg=mode_arg,
        eval_module=eval_module,
        train_kwargs=train_kwargs,
        eval_kwargs=eval_kwargs,
    )
    if variables is not None:
        net._init_from(variables, sample_inputs, init_kwargs, init_key, strict)
        return net
    if init_key is not None:
        return net.lazy_init(*sample_inputs, rngs=init_key, **init_kwargs)
    return net.lazy_init(*sample_inputs, **init_kwargs)
