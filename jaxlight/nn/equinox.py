"""Equinox models as NNX modules the trainer can train, called in Equinox's own idiom.

``from_equinox(model, state)`` returns an :class:`EquinoxModule`, an ordinary
NNX module, so the trainer needs no special case: the model's floating-point
array leaves become ``nnx.Param`` (trained), its other array leaves
:class:`EquinoxBuffer` (carried unchanged) and the values of its
``eqx.nn.State`` :class:`EquinoxState` (carried, updated by training calls).
Everything else in the model (activation functions, sizes, flags) is static.

Calling the wrapper runs the model the way Equinox code does by hand: vmapped
over the batch rows with ``axis_name="batch"`` (what ``eqx.nn.BatchNorm``
reduces over), the state threaded in and out, one dropout key per row drawn
from the wrapper's RNG stream, and ``eqx.nn.inference_mode`` in evaluation
(with every other boolean ``deterministic`` / ``train`` / ``training`` /
``is_training`` field of the model's modules at its evaluation value, and a
``train``/``inference``-style argument of the model's ``__call__`` that a
call leaves out filled from the mode). Equinox is imported only when a
wrapper is built.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlight.nn.linen import MODE_FIELDS, TRAIN_ARGS, _tracing, make_rngs, mode_arguments


class EquinoxState(nnx.Variable):
    """A value of an Equinox model's ``eqx.nn.State`` (BatchNorm statistics...): carried, not trained."""


class EquinoxBuffer(nnx.Variable):
    """An array leaf of an Equinox model that is not trained (integer arrays, leaves left out by
    ``trainable``): carried unchanged."""


def _key_name(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _path(keys: Sequence[Any]) -> tuple[str, ...]:
    return tuple(_key_name(k) for k in keys)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _nested_get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _nested_set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _axes_for(
    logical_axes: Mapping[str, Sequence[str | None]], paths: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[str | None, ...]]:
    """``{path: names}`` for the trained leaves the ``logical_axes`` patterns match (first match wins)."""
    out: dict[str, tuple[str | None, ...]] = {}
    for pattern, names in logical_axes.items():
        hits = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            listing = ", ".join(sorted(paths)[:20])
            raise ValueError(f"logical_axes pattern {pattern!r} matches no trained leaf; trained leaves: {listing}")
        names = tuple(names)
        for p in hits:
            if len(names) != len(paths[p]):
                raise ValueError(
                    f"logical_axes {names} for {p!r} name {len(names)} dims but the leaf has shape {paths[p]}"
                )
            out.setdefault(p, names)
    return out


class EquinoxModule(nnx.Module):
    """An Equinox model (and its ``eqx.nn.State``) held as NNX variables.

    Paths are the model's own (``model/layers/0/weight``,
    ``state/bn/state_index/0``). ``deterministic`` is the mode flag
    ``nnx.Module.train()`` / ``eval()`` set: in evaluation the model runs
    under ``eqx.nn.inference_mode``; in training it runs as given.
    """

    def __init__(
        self,
        model: Any,
        state: Any = None,
        *,
        batch_axis: str | None = "batch",
        rngs: Any = None,
        trainable: Any = None,
        logical_axes: Mapping[str, Sequence[str | None]] | None = None,
        mode_arg: bool = True,
        eval_model: Callable[[Any], Any] | None = None,
        train_kwargs: Mapping[str, Any] | None = None,
        eval_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        from jaxlight.integrations import require

        require("equinox", "jaxlight.nn.from_equinox")
        import equinox as eqx

        if not isinstance(model, eqx.Module):
            raise TypeError(f"from_equinox expects an equinox.Module, got {type(model).__name__}")
        model, state, index_paths = _split_state(model, state)
        keep = eqx.filter(model, eqx.is_inexact_array if trainable is None else trainable, replace=_NOT_TRAINED)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
        flags = treedef.flatten_up_to(keep)
        shapes = {
            "/".join(_path(p)): tuple(leaf.shape)
            for (p, leaf), f in zip(leaves, flags)
            if f is not _NOT_TRAINED and eqx.is_array(leaf)
        }
        axes = _axes_for(logical_axes or {}, shapes)
        new_leaves = []
        # Eager sharding off: placement is the trainer's (rules + heuristic), not flax's.
        with nnx.use_eager_sharding(False):
            for (p, leaf), f in zip(leaves, flags):
                name = "/".join(_path(p))
                if not eqx.is_array(leaf):
                    new_leaves.append(leaf)  # static: part of the graph definition
                elif f is _NOT_TRAINED:
                    new_leaves.append(EquinoxBuffer(jnp.asarray(leaf)))
                elif not eqx.is_inexact_array(leaf):
                    raise ValueError(
                        f"trainable selects leaf {name!r} of dtype {leaf.dtype}; only floating-point arrays can be "
                        f"trained (leave it out of trainable and it is carried unchanged)"
                    )
                elif name in axes:
                    new_leaves.append(nnx.Param(jnp.asarray(leaf), out_sharding=axes[name]))
                else:
                    new_leaves.append(nnx.Param(jnp.asarray(leaf)))
        self.model = nnx.data(jax.tree_util.tree_unflatten(treedef, new_leaves))
        if index_paths:
            state_leaves, self.state_def = jax.tree_util.tree_flatten(state)
            try:
                values = [state.get(index) for _, index in index_paths]
            except (KeyError, ValueError) as e:
                raise ValueError(
                    f"state does not belong to this model ({e!r}): build both with "
                    f"model, state = eqx.nn.make_with_state(Model)(...)"
                ) from e
            keys: list[tuple[str, ...]] = []
            store: dict[str, Any] = {}
            for (path, _), value in zip(index_paths, values):
                for sub, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                    key = path + _path(sub)
                    keys.append(key)
                    _nested_set(store, key, EquinoxState(leaf))
            if [id(x) for x in jax.tree_util.tree_leaves(values)] != [id(x) for x in state_leaves]:
                raise ValueError(
                    "state does not belong to this model: it holds other entries than the model's eqx.nn.StateIndex "
                    "layers (build both with model, state = eqx.nn.make_with_state(Model)(...))"
                )
            self.state = nnx.data(store)
            self.state_keys = tuple(keys)
        else:
            self.state = None
            self.state_def = None
            self.state_keys = ()
        self.rngs = nnx.data(make_rngs(rngs))
        self.batch_axis = batch_axis
        self.takes_key = _takes(type(model).__call__, "key")
        if self.takes_key and not {"dropout", "default"} & set(dict(self.rngs.items())):
            raise ValueError(
                f"the model takes key=, drawn from the 'dropout' stream of rngs (or its 'default' one); "
                f"rngs has only {sorted(dict(self.rngs.items()))}"
            )
        self.mode_arg = bool(mode_arg)
        if eval_model is not None and not callable(eval_model):
            raise TypeError(f"eval_model must be a callable model -> model, got {type(eval_model).__name__}")
        self.eval_model = eval_model  # static: part of the graph definition
        self.train_kwargs = tuple(dict(train_kwargs or {}).items())
        self.eval_kwargs = tuple(dict(eval_kwargs or {}).items())
        self.deterministic = False

    def _jaxlight_prepare_source(self, source: Any) -> Any:
        """load_variables: an Equinox model (or ``(model, state)``) becomes a pytree named like this wrapper."""
        import equinox as eqx

        model, state = source if isinstance(source, tuple) and len(source) == 2 else (source, None)
        if not isinstance(model, eqx.Module):
            return source
        named = EquinoxModule(model, state, batch_axis=self.batch_axis, rngs=0)
        return nnx.state(named, nnx.Not(nnx.RngState)).to_pure_dict()

    # -------------------------------------------------------------- Equinox views
    def eqx_module(self) -> Any:
        """The Equinox model built from the current arrays (traced ones inside a step); in
        evaluation mode under ``eqx.nn.inference_mode``."""
        import equinox as eqx

        model = jax.tree.map(
            lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
            self.model,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
        if not self.deterministic:
            return model
        if self.eval_model is not None:
            return self.eval_model(model)
        return _mode_flags_off(eqx.nn.inference_mode(model))

    def eqx_state(self) -> Any:
        """The model's ``eqx.nn.State`` built from the carried values (None for a stateless model)."""
        if self.state is None:
            return None
        leaves = [_nested_get(self.state, k).get_value() for k in self.state_keys]
        return jax.tree_util.tree_unflatten(self.state_def, leaves)

    def set_eqx_state(self, state: Any) -> None:
        """Store an updated ``eqx.nn.State`` (what a training call does after running the model)."""
        if self.state is None:
            raise ValueError("this Equinox model has no eqx.nn.State to set")
        leaves, treedef = jax.tree_util.tree_flatten(state)
        if treedef != self.state_def:
            raise ValueError(f"state structure changed: expected {self.state_def}, got {treedef}")
        for k, leaf in zip(self.state_keys, leaves):
            var = _nested_get(self.state, k)
            var.set_value(jnp.asarray(leaf).astype(var.get_value().dtype))  # stored in its own dtype

    # -------------------------------------------------------------- calling
    def __call__(self, *args: Any, key: jax.Array | None = None, **kwargs: Any) -> Any:
        """Run the model on a batch: ``self.net(x)``.

        With ``batch_axis`` (default ``"batch"``) the model sees one row at a
        time, ``jax.vmap``-ed over axis 0 of every positional argument with
        that axis name; keyword arguments go unchanged to every row. A stateful
        model is called ``model(*row, state, key=...)`` and must return
        ``(output, state)``; the new state is stored. When the model takes
        ``key``, one key is drawn from the ``dropout`` stream per call (unless
        given) and split into one key per row. Returns the output only.
        """
        model = self.eqx_module()
        state = self.eqx_state()
        stateful = state is not None
        if stateful:
            state = _in_compute_dtype(state, model)
        if self.takes_key and key is None:
            key = self.rngs.dropout()
        training = not self.deterministic
        kwargs = {**dict(self.train_kwargs if training else self.eval_kwargs), **kwargs}
        if self.mode_arg:
            shown = (*args, state) if stateful else args  # what the model is called with, row by row
            kwargs = {**kwargs, **mode_arguments(type(model).__call__, shown, kwargs, training)}

        def run(row: tuple, k: jax.Array | None) -> Any:
            kw = {**kwargs, "key": k} if self.takes_key else kwargs
            return model(*row, state, **kw) if stateful else model(*row, **kw)

        if self.batch_axis is None:
            out = run(args, key)
        else:
            rows = {int(x.shape[0]) for x in jax.tree.leaves(args) if getattr(x, "ndim", 0)}
            if len(rows) != 1:
                raise ValueError(
                    f"{type(model).__name__} is vmapped over axis 0 of its positional arguments (batch_axis="
                    f"{self.batch_axis!r}), which need one common number of rows; got {sorted(rows) or 'no arrays'}"
                )
            keys = None if key is None else jax.random.split(key, rows.pop())
            out = jax.vmap(
                run,
                in_axes=(0, None if keys is None else 0),
                out_axes=(0, None) if stateful else 0,
                axis_name=self.batch_axis,
            )(args, keys)
        if not stateful:
            return out
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"{type(model).__name__} holds eqx.nn.State, so it must return (output, state)")
        out, new_state = out
        self.set_eqx_state(new_state)
        return out


def _mode_flags_off(model: Any) -> Any:
    """``model`` with every boolean :data:`MODE_FIELDS` field of its modules at its evaluation value
    (``deterministic=True``, ``train``/``training``/``is_training=False``); ``inference`` is
    ``eqx.nn.inference_mode``'s. Static fields are left as they are (they are not leaves)."""
    import dataclasses

    import equinox as eqx

    for name in MODE_FIELDS:
        value = name not in TRAIN_ARGS

        def has(x: Any, n: str = name) -> bool:
            # by structure only (tree_at calls `where` on a tree whose leaves are placeholders)
            return isinstance(x, eqx.Module) and any(
                f.name == n and not f.metadata.get("static", False) for f in dataclasses.fields(x)
            )

        def where(m: Any, n: str = name, h: Callable = has) -> tuple:
            return tuple(getattr(x, n) for x in jax.tree_util.tree_leaves(m, is_leaf=h) if h(x))

        if not where(model):
            continue
        model = eqx.tree_at(
            where, model, replace_fn=lambda v, b=value: b if type(v) is bool else v, is_leaf=lambda x: x is None
        )
    return model


def _in_compute_dtype(state: Any, model: Any) -> Any:
    """Floating state in the parameters' dtype when they all share one (bf16 under "bf16-mixed"):
    Equinox layers mix state and activations without promotion (BatchNorm's ``lax.select``). The
    stored state keeps its own dtype (``set_eqx_state`` casts back)."""
    import equinox as eqx

    dtypes = {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))}
    if len(dtypes) != 1:
        return state
    (dt,) = dtypes
    return jax.tree.map(lambda s: s.astype(dt) if jnp.issubdtype(s.dtype, jnp.floating) else s, state)


class _NotTrained:
    def __repr__(self) -> str:
        return "<not trained>"


_NOT_TRAINED = _NotTrained()


def _split_state(model: Any, state: Any) -> tuple[Any, Any, list[tuple[tuple[str, ...], Any]]]:
    """(model without initial states, its eqx.nn.State, [(path, StateIndex)])."""
    import equinox as eqx

    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)
    found = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_index)[0] if is_index(x)]
    if not found:
        if state is not None and jax.tree_util.tree_leaves(state):
            raise ValueError("a state was given but the model has no eqx.nn.StateIndex layer to use it")
        return model, None, []
    if state is None:
        try:
            state = eqx.nn.State(model)
        except ValueError as e:  # make_with_state already moved the initial states out
            raise ValueError(
                "the model has stateful layers (eqx.nn.StateIndex) but no state was given: pass it, "
                "model, state = eqx.nn.make_with_state(Model)(...); from_equinox(model, state)"
            ) from e
    model = eqx.nn.delete_init_state(model)
    found = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_index)[0] if is_index(x)]
    return model, state, [(_path(p), x) for p, x in found]


def from_equinox(
    model: Any,
    state: Any = None,
    *,
    batch_axis: str | None = "batch",
    rngs: Any = None,
    trainable: Any = None,
    logical_axes: Mapping[str, Sequence[str | None]] | None = None,
    variables: Any = None,
    strict: bool = True,
    mode_arg: bool = True,
    eval_model: Callable[[Any], Any] | None = None,
    train_kwargs: Mapping[str, Any] | None = None,
    eval_kwargs: Mapping[str, Any] | None = None,
) -> EquinoxModule:
    """Wrap an Equinox model (and its ``eqx.nn.State``) as an NNX module the trainer trains as it is.

    Call it in ``configure_model``::

        model, state = eqx.nn.make_with_state(MLP)(jax.random.key(0))
        self.net = jl.nn.from_equinox(model, state)

    and ``self.net(x)`` in the steps (see :meth:`EquinoxModule.__call__`):
    rows vmapped with ``axis_name=batch_axis`` (``None``: the model gets the
    whole batch), state carried in training and read-only in evaluation
    (``eqx.nn.inference_mode``), dropout keys drawn per step.

    - ``trainable``: an Equinox filter (callable or filter-spec pytree) of the
      leaves to train; default ``eqx.is_inexact_array``. Other array leaves
      are carried unchanged.
    - ``rngs``: seed of the key stream (int, key, ``{stream: seed}`` or
      ``nnx.Rngs``); call n draws ``fold_in(key(seed), n)`` and splits it
      into one key per row.
    - ``logical_axes``: ``{path pattern: logical names}`` for trained leaves
      (``{"layers/*/weight": ("mlp", "embed")}``, fnmatch patterns against
      paths like ``layers/0/weight``), placed through the strategy's rules;
      unannotated leaves take the shape heuristic and the guardrail.

    - ``variables``: existing values to load after wrapping (an Equinox model
      or ``(model, state)`` with trained arrays, a ``{"model/l1/weight": ...}``
      pytree, a flax msgpack file or an orbax directory; see
      :func:`jaxlight.nn.load_variables`), with strict key and shape checks.
      A model that already holds its trained arrays needs none: they are
      what is wrapped. Outside a trace only (``__init__``, not
      ``configure_model``).
    - Evaluation runs ``eqx.nn.inference_mode(model)`` with every other
      boolean ``deterministic``/``train``/``training``/``is_training`` field
      of the model's modules at its evaluation value; ``eval_model`` (a
      callable ``model -> model``) replaces that. With ``mode_arg`` an
      argument of the model's ``__call__`` named like a mode switch
      (``inference``, ``deterministic``, ``train``...) that a call leaves out
      is filled from the mode. ``train_kwargs`` / ``eval_kwargs`` are
      keyword arguments every call of that mode gets.

    A model with ``eqx.nn.StateIndex`` layers and no ``state`` gets
    ``eqx.nn.State(model)`` (its initial states); the model's copies of the
    initial states are dropped (they would otherwise be trained).
    """
    net = EquinoxModule(
        model,
        state,
        batch_axis=batch_axis,
        rngs=rngs,
        trainable=trainable,
        logical_axes=logical_axes,
        mode_arg=mode_arg,
        eval_model=eval_model,
        train_kwargs=train_kwargs,
        eval_kwargs=eval_kwargs,
    )
    if variables is not None:
        if _tracing():
            raise RuntimeError(
                "from_equinox(..., variables=...) was called inside a jax trace (configure_model runs under "
                "jax.eval_shape and jit): build the wrapper in the LightningModule's __init__, or call "
                "jl.nn.load_variables(self.net, source) in on_fit_start"
            )
        from jaxlight.nn.variables import load_variables

        load_variables(net, variables, strict=strict)
    return net
