"""Hook dispatch: which callbacks and whether the module implement each hook, and the calls in Lightning's order.

:class:`HookCaller` is what the Trainer's ``call_hook`` runs: callbacks
first, then the module, each inside the reporter's hook scope so host-side
``self.log`` takes the hook's defaults. The questions "does ``obj`` implement
hook X itself" (:func:`overrides`), "can ``fn`` take argument X"
(:func:`takes_argument`) and "was ``fn`` written by the user"
(:func:`user_code`) are answered here and nowhere else.
"""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxlight.callbacks.callback import Callback
from jaxlight.callbacks.lr_scheduler import LRSchedulerStepper
from jaxlight.callbacks.model_checkpoint import ModelCheckpoint
from jaxlight.callbacks.preemption import Preemption
from jaxlight.callbacks.progress import TQDMProgressBar
from jaxlight.callbacks.timer import Timer
from jaxlight.errors import MisconfigurationError

if TYPE_CHECKING:  # pragma: no cover
    from jaxlight.config import TrainerConfig
    from jaxlight.module import LightningModule
    from jaxlight.reporting import MetricReporter
    from jaxlight.trainer import Trainer

CALLBACK_HOOKS: tuple[str, ...] = tuple(n for n, f in vars(Callback).items() if not n.startswith("_") and callable(f))
"""Every hook a Callback may implement (its public methods), in declaration order."""

_PER_BATCH_TRAIN_HOOKS = ("on_train_batch_start", "on_train_batch_end")
_BATCH_ARG = {"on_train_batch_start": 0, "on_train_batch_end": 1}  # where ``batch`` is in the module hook's arguments


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


def with_default_callbacks(cbs: list[Callback], config: TrainerConfig) -> list[Callback]:
    """The user's callbacks plus those the arguments ask for (progress bar, ``max_time``'s Timer,
    checkpointing, preemption handling), checkpoint callbacks last."""
    if config.enable_progress_bar is not False and not any(isinstance(c, TQDMProgressBar) for c in cbs):
        cbs = [*cbs, TQDMProgressBar()]
    if config.enable_progress_bar is False:
        cbs = [c for c in cbs if not isinstance(c, TQDMProgressBar)]
    if config.max_time is not None:
        cbs = [c for c in cbs if not isinstance(c, Timer)] + [Timer(config.max_time, interval="step")]
    if config.enable_checkpointing and not any(c.is_checkpoint_callback for c in cbs):
        cbs = [*cbs, ModelCheckpoint()]
    if not config.fast_dev_run and not any(isinstance(c, Preemption) for c in cbs):
        cbs = [*cbs, Preemption()]
    return checkpoint_callbacks_last(cbs)


def with_scheduler_stepper(cbs: list[Callback], host_stepped: bool) -> list[Callback] | None:
    """The callbacks with one :class:`LRSchedulerStepper` first when the optimizer has host-stepped
    schedules (plateau, epoch interval), so LearningRateMonitor reads the rates it sets, and none
    otherwise; None when that is the list as it is."""
    others = [c for c in cbs if not isinstance(c, LRSchedulerStepper)]
    stepper = [LRSchedulerStepper()] if host_stepped else []
    if not stepper and len(others) == len(cbs):
        return None
    return checkpoint_callbacks_last(stepper + others)


def checkpoint_callbacks_last(cbs: Sequence[Callback]) -> list[Callback]:
    """Lightning runs checkpoint callbacks after all others at every hook, so a checkpoint holds the
    other callbacks' state as updated by the same hook (e.g. EarlyStopping's wait count)."""
    return [c for c in cbs if not c.is_checkpoint_callback] + [c for c in cbs if c.is_checkpoint_callback]


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
    "HookCaller",
    "check_callbacks",
    "checkpoint_callbacks_last",
    "names_parameter",
    "overrides",
    "parameters",
    "step_call",
    "takes_argument",
    "user_code",
    "with_default_callbacks",
    "with_scheduler_stepper",
]
