"""Errors shared by the trainer's modules.

Each is raised in one module and caught or matched in others (the loops, the
strategies, the tests), so it lives here rather than beside the code that
raises it; the old import paths (``jaxlight.data.BatchError``) keep working.
"""


class MisconfigurationError(ValueError):
    """A Trainer argument or a module definition that cannot work, said before any work is done."""


class NotADirectoryMisconfiguration(MisconfigurationError, NotADirectoryError):
    """A directory argument (a logger's save_dir, a checkpoint dirpath) names an existing file: both a
    ``MisconfigurationError`` and the ``NotADirectoryError`` the filesystem would raise later."""


class BatchError(ValueError):
    """A batch the compiled step cannot take (shapes disagree, rows don't divide)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, corrupt, or not matching the model."""


class NonFiniteLossWarning(UserWarning):
    """The training loss was NaN or Inf when the trainer fetched it (once per fit; training goes on).

    The trainer's default notice; ``NonFiniteGuard`` stops the run or skips such updates instead.
    """


class Preempted(SystemExit):
    """``fit`` stopped at a preemption signal after writing that step's checkpoint.

    A ``SystemExit`` with code 143 (128 + SIGTERM), so an uncaught one ends the
    program the way schedulers expect from a preempted job. ``step`` is the
    global step the run stopped at, ``path`` the checkpoint written there (None
    when checkpointing is disabled), ``signum`` the signal received. Running
    the same script again with ``ckpt_path="last"`` resumes at that point.
    """

    def __init__(self, step: int, path: str | None = None, signum: int | None = None) -> None:
        super().__init__(143)
        self.step = step
        self.path = path
        self.signum = signum

    def __str__(self) -> str:
        where = f"; checkpoint {self.path}" if self.path else "; no checkpoint written (checkpointing disabled)"
        return f"preempted (signal {self.signum}) at global step {self.step}{where}"


class HostSideEffectWarning(UserWarning):
    """A step method changed host state (a plain attribute of the module, a list it holds, an attribute of a
    plain object such as an agent or a replay buffer) while it was traced.

    Step methods run once, when the step is traced, and then as a compiled program that never runs their
    Python code again: the change happened once and will not happen per batch. Host work per batch belongs
    in a host hook (``on_train_batch_start``) or the data loader.
    """


class Float32MatmulWarning(UserWarning):
    """A half-precision policy (``"bf16-mixed"``...) left more than 5% of the train step's matrix-product FLOPs
    with a float32 operand (counted from the traced step, once, when it is first compiled).

    The message names the flax layers that set their own ``dtype`` (which the policy keeps) and where the
    float32 products come from (Linen module paths, source lines). Such products run at the float32 rate:
    on a GPU or TPU a fraction of the half-precision peak.
    """
