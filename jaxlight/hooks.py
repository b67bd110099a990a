"""Hook dispatch: which callbacks and whether the module implement each hook, and the calls in Lightning's order.

:class:`HookCaller` is what the Trainer's ``call_hook`` runs: callbacks
first, then the module, each inside the reporter's hook scope so host-side
``self.log`` takes the hook's defaults. "Was ``fn`` written by the user"
(:func:`user_code`) and "may ``fn`` read argument X" (:func:`reads_argument`)
are answered here; what a function accepts (:func:`overrides`,
:func:`takes_argument`, :func:`step_call`) lives in :mod:`jaxlight.signatures`,
below the engine, and is re-exported here. This module knows callbacks only
through what :class:`~jaxlight.callbacks.Callback` declares; which callbacks a
Trainer adds by default is the facade's business
(:mod:`jaxlight.default_callbacks`).
"""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxlight.callbacks.callback import Callback
from jaxlight.errors import MisconfigurationError
from jaxlight.signatures import STEP_FORMS, names_parameter, overrides, parameters, step_call, takes_argument

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.module import LightningModule
    from jaxlight.reporting import MetricReporter
    from jaxlight.trainer import Trainer

CALLBACK_HOOKS: tuple[str, ...] = tuple(n for n, f in vars(Callback).items() if not n.startswith("_") and callable(f))
"""Every hook a Callback may implement (its public methods), in declaration order."""

_PER_BATCH_TRAIN_HOOKS = ("on_train_batch_start", "on_train_batch_end")
_BATCH_ARG = {"on_train_batch_start": 0, "on_train_batch_end": 1}  # where ``batch`` is in the module hook's arguments


_FRAME_READERS = frozenset({"locals", "vars", "eval", "exec", "_getframe", "currentframe", "getframeinfo", "stack"})
"""Names through which a function can read its own local variables without naming them (``locals()``, frames)."""


def reads_argument(fn: Any, position: int) -> bool:
    """Whether ``fn`` may read the argument passed at ``position`` (0-based, after ``self`` for a bound method).

    False only when that is plain to see in ``fn``'s code: a Python function whose parameter at that position
    is never loaded (no ``LOAD_FAST``/``LOAD_DEREF`` of its name, not captured by an inner function) and whose
    code names nothing that reads locals or frames (``locals``, ``vars``, ``eval``, ``exec``, frame functions).
    True for anything else: ``*args``, a builtin, a callable object, a decorated function (its wrapper takes
    ``*args``), a parameter missing at that position. The loop asks this of per-batch hooks: one that never
    reads its ``batch`` is not given the batch placed on the devices (see :meth:`HookCaller.reads_batch`).
    """
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None or not isinstance(func, types.FunctionType):
        return True
    index = position + (1 if inspect.ismethod(fn) else 0)
    if index >= code.co_argcount:
        return True  # it reaches *args (or the call would fail): unknown
    name = code.co_varnames[index]
    if name in code.co_cellvars or _FRAME_READERS.intersection(code.co_names):
        return True
    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "DELETE_FAST", "STORE_FAST")):
            val = ins.argval
            if val == name or (isinstance(val, tuple) and name in val):
                return True
    return False


def user_code(fn: Any) -> bool:
    """Whether ``fn`` (a bound method or a function) was written outside jaxlight."""
    fn = getattr(fn, "__func__", fn)
    module = getattr(fn, "__module__", None)
    return not (isinstance(module, str) and (module == "jaxlight" or module.startswith("jaxlight.")))


def _own(cb: Callback, hook: str) -> bool:
    """Whether ``cb.<hook>`` runs only jaxlight's code: one of jaxlight's own callback classes (not a user's
    subclass of one) whose hook is the class's method (not a function set on the instance, as
    ``LambdaCallback`` holds the user's)."""
    return type(cb).__module__.startswith("jaxlight.") and not user_code(getattr(cb, hook))


def check_callbacks(callbacks: Callback | Sequence[Callback] | None) -> list[Callback]:
    """The Trainer's ``callbacks`` argument as a list, every element a jaxlight Callback."""
    if callbacks is None:
        cbs: list[Callback] = []
    elif isinstance(callbacks, Callback):
        cbs = [callbacks]
    else:
        cbs = list(callbacks)
    for cb in cbs:
        if not isinstance(cb, Callback):
            raise MisconfigurationError(f"callbacks must be jaxlight.Callback instances, got {type(cb).__name__}")
    return cbs


def checkpoint_callbacks_last(cbs: Sequence[Callback]) -> list[Callback]:
    """Lightning runs checkpoint callbacks after all others at every hook, so a checkpoint holds the
    other callbacks' state as updated by the same hook (e.g. EarlyStopping's wait count)."""
    return [c for c in cbs if not c.is_checkpoint_callback] + [c for c in cbs if c.is_checkpoint_callback]


def stop_poll(callbacks: Sequence[Callback]) -> Callable[[bool], None] | None:
    """The :attr:`~jaxlight.callbacks.Callback.stop_poll` of the first callback among ``callbacks`` that
    declares one (what the loops hand their prefetchers: Preemption's), or None."""
    return next((c.stop_poll for c in callbacks if c.stop_poll is not None), None)


class HookCaller:
    """Calls hooks on the callbacks, then on the module, through a table built once per run.

    ``callbacks`` is the Trainer's list (``trainer.callbacks`` is this list);
    ``module`` is the attached LightningModule. :meth:`build` records, per
    hook, the callbacks that implement it and whether the module does, so the
    dispatch never calls a no-op (the train loop asks twice per step).
    Callback hooks receive ``trainer`` first, as in Lightning.
    """

    def __init__(self, trainer: Trainer, reporter: MetricReporter, callbacks: Sequence[Callback] = ()) -> None:
        self._trainer = trainer
        self.reporter = reporter
        self.callbacks: list[Callback] = list(callbacks)
        self.module: LightningModule | None = None
        self._table: dict[str, tuple[list[Callback], bool]] = {}
        self._module_readers: set[str] = set()
        self._batch_readers: set[str] = set()
        self._foreign: dict[str, bool] = {}  # per hook: whether a callback implementing it runs user code

    def attach(self, module: LightningModule) -> None:
        """Serve ``module``: its ``configure_callbacks()`` replace the Trainer's callbacks of the same
        types (Lightning's rule), then the table is built."""
        self.module = module
        extra = module.configure_callbacks()
        extra = [extra] if isinstance(extra, Callback) else list(extra or [])
        if extra:
            kinds = {type(c) for c in extra}
            self.callbacks = checkpoint_callbacks_last([c for c in self.callbacks if type(c) not in kinds] + extra)
        self.build()

    def build(self) -> None:
        """Per hook, the callbacks that implement it and whether the module does; and which per-batch
        train hooks run user code that may read the module's NNX attributes."""
        module = self.module
        self._table, self._foreign = {}, {}
        for name in CALLBACK_HOOKS:
            cbs = [c for c in self.callbacks if overrides(c, name)]
            self._table[name] = (cbs, module is not None and overrides(module, name))
            self._foreign[name] = any(not _own(c, name) for c in cbs)
        # Hooks whose user code may read the module's NNX attributes between train steps (the step donates
        # the arrays they point at): the loop re-points them at the new state before calling these only.
        self._module_readers = set()
        saving = any(user_code(c.on_save_checkpoint) for c in self._table["on_save_checkpoint"][0])
        saving |= self._table["on_save_checkpoint"][1]
        self._batch_readers = set()
        for name in _PER_BATCH_TRAIN_HOOKS:
            cbs, mod = self._table[name]
            user = any(user_code(getattr(c, name)) for c in cbs) or (mod and user_code(getattr(module, name)))
            if user or (saving and cbs):
                self._module_readers.add(name)
            at = _BATCH_ARG[name]  # callbacks get (trainer, pl_module) first
            if any(reads_argument(getattr(c, name), at + 2) for c in cbs) or (
                mod and reads_argument(getattr(module, name), at)
            ):
                self._batch_readers.add(name)

    def reads_module(self, hook: str) -> bool:
        """Whether a user's implementation of per-batch ``hook`` runs this fit (so the loop points the
        module's attributes at the current train state first; jaxlight's own callbacks never read them)."""
        return hook in self._module_readers

    def reads_batch(self, hook: str) -> bool:
        """Whether an implementation of per-batch train hook ``hook`` (a callback's or the module's) may read its
        ``batch`` argument (:func:`reads_argument`). When none does, the loop may give the compiled step the
        loader's host arrays to transfer itself (one device on CPU), and the hooks then get those host arrays,
        which they never look at."""
        return hook in self._batch_readers

    def eval_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters evaluation runs on: ``params``, or a callback's (e.g. EMA) when it provides them."""
        for cb in self.callbacks:
            alt = cb.eval_params(self._trainer, params)
            if alt is not None:
                params = alt
        return params

    def call(self, hook: str, *args: Any, module: bool = True, callbacks: Sequence[Callback] | None = None) -> Any:
        """Call ``hook`` on the callbacks (those given, or every one that implements it), then on the
        module; host-side ``self.log`` calls made inside take the hook's defaults. Returns the module's
        result.

        The train loop calls two hooks per step, so this is its per-step dispatch: a table lookup, the
        hook's scope on the reporter (a slotted class, no generator), and the engine told which hook ran only
        when code other than jaxlight's own callbacks ran (only that can replace the module's NNX
        attributes)."""
        table = self._table.get(hook)
        if table is None:
            cbs, mod = list(self.callbacks), hasattr(self.module, hook)
        else:
            cbs, mod = table
        if callbacks is not None:
            cbs = [c for c in callbacks if c in cbs or table is None]
        run_module = module and mod and self.module is not None
        if not cbs and not run_module:
            return None  # nothing implements it: no bookkeeping
        reporter, trainer, target = self.reporter, self._trainer, self.module
        result = None
        with reporter.in_hook(hook):
            for cb in cbs:
                getattr(cb, hook)(trainer, target, *args)
                reporter.flush_host_logs()
            if run_module:
                result = getattr(target, hook)(*args)
                reporter.flush_host_logs()
        foreign = self._foreign.get(hook, True) if callbacks is None else any(not _own(c, hook) for c in cbs)
        if run_module or foreign:
            engine = getattr(trainer, "engine", None)
            if engine is not None:
                # a hook that replaced held NNX state is named if the step must refuse it
                engine.binding.note_hook(hook)
        return result

    def call_on_exception(self, exception: BaseException) -> None:
        """``on_exception`` on every callback, then on the module; errors they raise are dropped (the
        original error matters more)."""
        for cb in self.callbacks:
            try:
                cb.on_exception(self._trainer, self.module, exception)
            except Exception:
                pass
        if hasattr(self.module, "on_exception"):
            try:
                self.module.on_exception(exception)  # type: ignore[union-attr]
            except Exception:
                pass

    def call_module(self, hook: str, *args: Any) -> Any:
        """Call a module-only hook (``configure_optimizers``, ``on_validation_model_eval`` ...)."""
        with self.reporter.in_hook(hook):
            out = getattr(self.module, hook)(*args)
            self.reporter.flush_host_logs()
            return out


__all__ = [
    "CALLBACK_HOOKS",
    "STEP_FORMS",
    "HookCaller",
    "check_callbacks",
    "checkpoint_callbacks_last",
    "names_parameter",
    "overrides",
    "parameters",
    "reads_argument",
    "step_call",
    "stop_poll",
    "takes_argument",
    "user_code",
]
