"""The Trainer's parts: the frozen TrainerConfig, the hook questions (overrides, signatures) and the one
host-side logging path for callbacks."""

from __future__ import annotations

import dataclasses

import pytest

import jaxlight as jl
from jaxlight.config import TrainerConfig
from jaxlight.hooks import overrides, takes_argument


class _Quiet(jl.Callback):
    def on_train_start(self, trainer, pl_module):
        pass


def test_config_is_frozen_and_the_trainer_reads_it():
    trainer = jl.Trainer(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert isinstance(trainer.config, TrainerConfig)
    assert trainer.max_epochs == -1 and trainer.max_steps == 5 and trainer.log_every_n_steps == 50
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.config.max_steps = 3  # type: ignore[misc]
    before = trainer.config
    trainer.limit_val_batches = 0  # a plain assignment, as before: replaces the config for the next run
    assert trainer.config is not before and trainer.config.limit_val_batches == 0 and before.limit_val_batches is None


def test_fast_dev_run_is_resolved_in_the_config():
    config = TrainerConfig.from_arguments(fast_dev_run=True)
    assert (config.fast_dev_run, config.max_steps, config.max_epochs, config.num_sanity_val_steps) == (1, 1, 1, 0)
    assert config.loggers == () and config.enable_checkpointing is False
    assert config.limit_val_batches == config.limit_train_batches == 1


def test_stepping_batches_counts_partial_windows():
    config = TrainerConfig.from_arguments(max_epochs=2, accumulate_grad_batches=3, logger=False)
    assert config.stepping_batches(10) == 8  # ceil(10 / 3) per epoch
    assert config.stepping_batches(float("inf")) is None
    assert TrainerConfig.from_arguments(max_steps=7, logger=False).stepping_batches(10) == 7


def test_overrides_sees_subclasses_and_instance_attributes():
    assert overrides(_Quiet(), "on_train_start")
    assert not overrides(_Quiet(), "on_train_end")
    assert not overrides(jl.Callback(), "on_train_start")
    cb = jl.Callback()
    cb.on_train_end = lambda trainer, pl_module: None
    assert overrides(cb, "on_train_end")
    assert not overrides(cb, "no_such_hook")

    class M(jl.LightningModule):
        def validation_step(self, batch, batch_idx):
            return None

    assert overrides(M(), "validation_step") and not overrides(M(), "test_step")


def test_takes_argument_reads_positions_names_and_varargs():
    assert takes_argument(lambda batch, batch_idx, dataloader_idx=0: None, "dataloader_idx", 2)
    assert takes_argument(lambda batch, batch_idx, idx: None, "dataloader_idx", 2)  # positional, any name
    assert takes_argument(lambda *args: None, "dataloader_idx", 2)
    assert takes_argument(lambda batch, batch_idx: None, "dataloader_idx", 2) is False
    assert takes_argument(lambda batch, batch_idx, **kw: None, "dataloader_idx", 2) is False  # passed positionally
    assert takes_argument(print, "dataloader_idx", 2) in (True, None)  # a builtin may have no signature


def test_reporter_log_metrics_goes_to_the_loggers_at_the_producing_step(tmp_path):
    class Memory(jl.loggers.Logger):
        def __init__(self):
            self.rows = []

        @property
        def name(self):
            return "memory"

        @property
        def version(self):
            return 0

        def log_metrics(self, metrics, step=None):
            self.rows.append((dict(metrics), step))

        def log_hyperparams(self, params):
            pass

    memory = Memory()
    trainer = jl.Trainer(logger=memory, enable_checkpointing=False, enable_progress_bar=False)
    trainer.global_step = 4
    trainer.reporter.log_metrics({"train/step_time": 0.5})
    assert memory.rows == [({"train/step_time": 0.5}, 3)]  # no "epoch" entry
    assert "train/step_time" not in trainer.logged_metrics  # Lightning: callbacks' own logger calls are not in it
    trainer.reporter.log_metrics({"lr": 0.1}, step=9)
    assert memory.rows[-1] == ({"lr": 0.1}, 9)
