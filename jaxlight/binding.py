"""The one binding between the run's state and the user's module attributes.

The train state (:class:`~jaxlight.step.TrainState`) is the value the compiled
steps carry; the user's ``LightningModule`` shows it through its NNX
attributes, so that hooks, ``self.net(x)`` in a host hook and users' own
references (``net = model.net``) see the current weights. This module is the
only code that points those attributes at the state's arrays
(:meth:`ModuleBinding.write_back`, :meth:`~ModuleBinding.sync_module`) and the
only code that reads back what host code set in them (weights loaded in a
hook, ``metrics.reset()``, ``self.count.value = 0``):
:meth:`~ModuleBinding.module_edits` tells those writes from the arrays it last
wrote, and :meth:`~ModuleBinding.adopt_host_edits` puts them into the state
before the next compiled step (placed like the leaves they replace), so the
state stays the one copy the step trains.

It works at defined points only: the loop syncs the module before a hook that
reads it, the compiled train step adopts edits as it is called, evaluation
steps carry their non-parameter state both ways, and a stage's end writes
the state back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxlight.compat import variable_value_setter
from jaxlight.errors import MisconfigurationError
from jaxlight.precision import Precision
from jaxlight.state import ModelParts, graph_root, is_nnx_object, merge_models, path_str, split_state

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.module import LightningModule
    from jaxlight.step import TrainState


class StateHome(Protocol):
    """Where the run's state lives (the engine): the module served, its parts, the train state and the
    shardings a host edit is placed in."""

    module: LightningModule | None
    parts: ModelParts | None
    train_state: TrainState | None
    param_shardings: dict[str, NamedSharding]
    rest_shardings: dict[str, NamedSharding]
    precision: Precision


class ModuleBinding:
    """Points the module's NNX attributes at the state's arrays and adopts host code's writes into them."""

    def __init__(self, home: StateHome) -> None:
        self.home = home
        self._synced: Any = None  # the train state the module's attributes point at
        self._slots: tuple[tuple[int, ...], list | None] | None = None  # the module's variables, by key
        # (params, rest, attribute ids) last written into the module: what host hooks' edits are told from
        self._written: tuple[Mapping, Mapping, tuple[int, ...]] | None = None
        self._adopting = False  # inside a write that points the module at edits just adopted
        self._replaced_in: str | None = None  # the first hook since that write that replaced an NNX attribute

    def reset(self, synced: bool) -> None:
        """Forget what was written into the module (a new module or new parts); ``synced``: also which train
        state it shows."""
        if synced:
            self._synced = None
        self._slots = None
        self._written = None

    def write_back(self, params: Mapping, rest: Mapping) -> None:
        """Point the module's NNX attributes at concrete (sharded) arrays.

        Existing NNX modules are updated in place, as a torch module is, so any
        other reference the user holds to them (``net = model.net``) sees the
        new values too; modules not created yet are built from the state.
        """
        assert self.home.parts is not None and self.home.module is not None
        self.adopt_pending_edits()  # what a host hook set in the arrays the module shows is not overwritten
        self._synced = None  # the module now holds these arrays, whatever the train state is
        module, parts = self.home.module, self.home.parts
        current = {k: module.__dict__.get(k) for k in parts.names}
        if all(is_nnx_object(m) for m in current.values()):
            slots = self._variable_slots(current)
            if slots is None:
                nnx.update(graph_root(parts, current), parts.params.from_flat(params), parts.rest.from_flat(rest))
            else:
                # the per-step path (a user's per-batch hook): set each variable's array, no graph walk and no
                # per-variable trace check (the loop is on the host, outside any trace; compat says why)
                set_value = variable_value_setter()
                for var, is_param, key in slots:
                    set_value(var, params[key] if is_param else rest[key])
        else:
            for k, m in merge_models(parts, params, rest, train=None).items():  # the modes configure_model set
                object.__setattr__(module, k, m)
        self._written = (params, rest, tuple(id(module.__dict__.get(k)) for k in parts.names))
        self._replaced_in = None

    def _variable_slots(self, current: Mapping[str, nnx.Module]) -> list[tuple[Any, bool, str]] | None:
        """The module's NNX variables by flat key, found once per set of module objects (None when they
        do not match the state's keys, e.g. a submodule was replaced: then ``nnx.update`` does the work)."""
        assert self.home.parts is not None
        ident = tuple(id(m) for m in current.values())
        if self._slots is not None and self._slots[0] == ident:
            return self._slots[1]
        found: dict[str, Any] = {}
        for path, node in nnx.iter_graph(graph_root(self.home.parts, current)):
            if isinstance(node, nnx.Variable):
                found.setdefault(path_str(path[1:]), node)
        keys = [(True, k) for k in self.home.parts.params.keys] + [(False, k) for k in self.home.parts.rest.keys]
        slots = None if any(k not in found for _, k in keys) else [(found[k], p, k) for p, k in keys]
        self._slots = (ident, slots)
        return slots

    def read_module(self) -> tuple[dict, dict]:
        """Current params/rest from the module's NNX attributes (the user may have changed them); the
        module is pointed at the placed arrays, so host hooks' later edits are told from them."""
        assert self.home.parts is not None and self.home.module is not None
        models = {k: getattr(self.home.module, k) for k in self.home.parts.names}
        params, rest = split_state(self.home.parts, models)
        params = jax.device_put(params, self.home.param_shardings)
        rest = jax.device_put(rest, self.home.rest_shardings)
        self.write_back(params, rest)
        return params, rest

    def sync_module(self) -> None:
        """Point the module's attributes at the current train state (host work only, no copy).

        Free when they already do (the same ``train_state`` object as at the last
        sync), so the loop may call it before every hook that could read them.
        """
        state = self.home.train_state
        if state is not None and state is not self._synced:
            self.write_back(state.params, state.model_state)
            self._synced = state

    def module_leaves(self) -> list[Any]:
        """The arrays the module's NNX attributes hold now, in a fixed order (to notice a user's edit)."""
        assert self.home.parts is not None and self.home.module is not None
        models = {k: getattr(self.home.module, k, None) for k in self.home.parts.names}
        if not all(is_nnx_object(m) for m in models.values()):
            return []
        return jax.tree.leaves(nnx.state(graph_root(self.home.parts, models)))

    @contextlib.contextmanager
    def adopting_module_edits(self) -> Iterator[None]:
        """Run host code after which the module's attributes may hold other arrays (the user loaded
        weights into them in a hook): afterwards the train state is built from what they hold."""
        before = self.module_leaves()
        yield
        after = self.module_leaves()
        if len(before) != len(after) or any(a is not b for a, b in zip(before, after)):
            self.adopt_module_edits()

    def adopt_module_edits(self) -> None:
        """Train from what the module's attributes hold now (a user loaded weights into them in a hook).

        Parameters and other state are read back and placed in the train
        state's shardings; optimizer and callback state are kept as they are.
        """
        if self.home.train_state is None:
            return
        params, rest = self.read_module()
        params = self.home.precision.store(params)
        self.home.train_state = self.home.train_state._replace(params=params, model_state=rest)
        self.sync_module()

    def module_edits(self, params: Mapping | None, rest: Mapping | None) -> dict[tuple[bool, str], Any]:
        """What host code set in the module's NNX variables since ``params``/``rest`` were written into it
        (``metrics.reset()``, ``self.count.value = 0``, weights loaded in a hook), as
        ``{(is_param, key): value}``.

        Empty when the module does not show those dicts (it was pointed at other arrays since: nothing to
        tell edits from) or nothing was set. One identity check per variable, so free enough to run before
        every step whose state the module shows; an attribute replaced by another NNX object is read whole.
        """
        w = self._written
        if w is None or self.home.parts is None or self.home.module is None:
            return {}
        shown = (params is not None and w[0] is params, rest is not None and w[1] is rest)
        if not any(shown):
            return {}
        d = self.home.module.__dict__
        slots = self._slots[1] if self._slots is not None and self._slots[0] == w[2] else None
        if slots is not None and tuple(id(d.get(k)) for k in self.home.parts.names) == w[2]:
            # the per-step path (a user's per-batch hook ran): one identity check per variable
            edits: dict[tuple[bool, str], Any] = {}
            for var, is_param, key in slots:
                if shown[0 if is_param else 1]:
                    value = var.get_raw_value()
                    if value is not w[0 if is_param else 1][key]:
                        edits[(is_param, key)] = value
            return edits
        fp, fr = self._read_replaced({k: d.get(k) for k in self.home.parts.names})
        held = [(True, k, v) for k, v in fp.items()] + [(False, k, v) for k, v in fr.items()]
        return {
            (is_param, key): value
            for is_param, key, value in held
            if shown[0 if is_param else 1] and value is not w[0 if is_param else 1][key]
        }

    def note_hook(self, hook: str) -> None:
        """After host hook ``hook`` ran (:class:`~jaxlight.hooks.HookCaller` calls this): remember it when it
        replaced one of the module's NNX attributes, so that a replacement the step cannot carry is refused
        naming the hook. One tuple of ids compared, nothing when an earlier hook already did it."""
        w, parts, module = self._written, self.home.parts, self.home.module
        if w is None or self._replaced_in is not None or parts is None or module is None:
            return
        d = module.__dict__
        if tuple(id(d.get(k)) for k in parts.names) != w[2]:
            self._replaced_in = hook

    def _read_replaced(self, current: Mapping[str, Any]) -> tuple[dict, dict]:
        """The flat state of attributes host code replaced; a clear error when it no longer fits the step."""
        assert self.home.parts is not None
        owner = type(self.home.module).__name__
        who = f"hook {self._replaced_in}" if self._replaced_in else "host code (outside the hooks)"
        gone = [k for k, v in current.items() if not is_nnx_object(v)]
        if gone:
            raise MisconfigurationError(
                f"{who} replaced or removed {owner}.{', '.join(gone)}, which held NNX state the compiled step "
                f"carries (now {', '.join(type(current[k]).__name__ for k in gone)}); set its values instead "
                f"(metrics.reset(), var.value = ...) or assign an NNX object with the same variables"
            )
        try:
            return split_state(self.home.parts, current)
        except ValueError as e:
            ids = self._written[2] if self._written is not None else ()
            replaced = [k for k, i in zip(current, ids) if id(current[k]) != i] or list(current)
            raise MisconfigurationError(
                f"{who} gave {owner}.{', '.join(replaced)} other NNX variables than the compiled step carries "
                f"({e}); set their values instead of replacing them"
            ) from None

    def _placed(self, is_param: bool, key: str, value: Any, like: Any) -> Any:
        """A value host code set, as the leaf it replaces: its dtype, its sharding (shape checked)."""
        if tuple(np.shape(value)) != tuple(like.shape):
            raise MisconfigurationError(
                f"a hook set {'parameter' if is_param else 'variable'} {key} to shape {tuple(np.shape(value))}; "
                f"the compiled step carries it with shape {tuple(like.shape)}"
            )
        value = value if isinstance(value, jax.Array) else jnp.asarray(value)
        if value.dtype != like.dtype:
            value = value.astype(like.dtype)
        return jax.device_put(value, (self.home.param_shardings if is_param else self.home.rest_shardings)[key])

    def _adopt(self, params: dict | None, rest: dict | None) -> None:
        """Put what host code set in the module (:meth:`module_edits`) into ``params``/``rest``, in place,
        placed like the leaves they replace, and point the module at the placed arrays."""
        edits = self.module_edits(params, rest)
        if not edits:
            return
        # The train step donates every leaf, so no two leaves may share an array: a hook that copies weights
        # between modules (``nnx.update(self.target, nnx.state(self.net))``) hands one array to both. Such a
        # value gets its own copy (a device copy, only for those edits).
        taken = {
            id(v)
            for is_param, group in ((True, params), (False, rest))
            if group is not None
            for k, v in group.items()
            if (is_param, k) not in edits
        }
        for (is_param, key), value in edits.items():
            group = params if is_param else rest
            assert group is not None
            placed = self._placed(is_param, key, value, group[key])
            if id(placed) in taken:
                placed = jax.device_put(placed, placed.sharding, may_alias=False)
            taken.add(id(placed))
            group[key] = placed
        self._point(set(edits))

    def _point(self, keys: set[tuple[bool, str]]) -> None:
        """Point the module's variables ``keys`` (``(is_param, key)``) at the dicts it shows."""
        w = self._written
        assert w is not None
        slots = self._slots[1] if self._slots is not None and self._slots[0] == w[2] else None
        current = tuple(id(self.home.module.__dict__.get(k)) for k in self.home.parts.names)
        if slots is None or current != w[2]:  # attributes were replaced: a full write (no adoption inside)
            self._adopting, synced = True, self._synced
            try:
                self.write_back(w[0], w[1])
            finally:
                self._adopting, self._synced = False, synced
            return
        set_value = variable_value_setter()
        for var, is_param, key in slots:
            if (is_param, key) in keys:
                set_value(var, (w[0] if is_param else w[1])[key])

    def adopt_pending_edits(self) -> None:
        """Before the module is pointed at other arrays: what host code set in the train state's arrays
        it shows goes into the train state (in place), e.g. ``metrics.reset()`` in
        ``on_validation_epoch_end`` before the loop syncs the module for ``on_train_epoch_end``."""
        st = self.home.train_state
        if st is None or self._written is None or self._adopting:
            return
        self._adopt(st.params, st.model_state)

    def adopt_host_edits(self, state: TrainState) -> TrainState:
        """``state`` with what host hooks set in the module since it was pointed at ``state``'s arrays
        (:meth:`module_edits`), in place, placed like the leaves they replace; the module then shows the
        placed arrays. No work beyond two identity checks when the module does not show ``state`` (no
        hook ran since the last step). The compiled train step calls this first."""
        self._adopt(state.params, state.model_state)
        return state

    def carry_into_eval(self, rest: dict) -> None:
        """Before an evaluation step: what host hooks set in the module's non-parameter state
        (``self.val_metrics.reset()`` in ``on_validation_epoch_start``) goes into ``rest``, in place (the
        dict the evaluation loop passes to each of its steps)."""
        self._adopt(None, rest)

    def carry_from_eval(self, rest: dict, changed: Mapping[str, Any]) -> None:
        """After an evaluation step: the variables it set (metrics updated, a holder's RNG stream drawn)
        go into ``rest`` in place, so the next step and the hooks (through the module) see them."""
        for key, value in changed.items():
            sh = self.home.rest_shardings[key]
            rest[key] = value if value.sharding == sh else jax.device_put(value, sh)
        if self._written is not None and self._written[1] is rest:
            self._point({(False, k) for k in changed})


__all__ = ["ModuleBinding", "StateHome"]
