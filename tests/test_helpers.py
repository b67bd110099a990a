"""The shared test helpers (tests/helpers.py) do what the tests that use them rely on, without a fit."""

from __future__ import annotations

import signal
import socket
import types

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlight as jl
from tests.helpers import Losses, Record, SignalAt, free_port, host_params, quiet, wait_for_files


def test_quiet_silences_and_none_hands_an_argument_back_to_the_trainer():
    assert quiet() == dict(
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    got = quiet(devices=1, enable_checkpointing=None, num_sanity_val_steps=2, max_epochs=None)
    assert "enable_checkpointing" not in got  # left to the Trainer (and to the caller's own argument)
    assert got["num_sanity_val_steps"] == 2 and got["devices"] == 1
    assert "max_epochs" in got and got["max_epochs"] is None  # None is dropped only for the five quiet ones
    trainer = jl.Trainer(enable_checkpointing=False, **quiet(enable_checkpointing=None))  # no duplicate argument
    assert trainer.config.enable_progress_bar is False and trainer.config.enable_checkpointing is False


def test_losses_records_one_value_or_a_tuple_per_step_as_given_or_as_floats():
    outs = [{"loss": np.float32(0.5), "d_loss": np.float32(1.5)}, {"loss": np.float32(0.25), "d_loss": np.float32(2.0)}]
    raw, floats, pairs = Losses(), Losses(as_float=True), Losses(("d_loss", "loss"), as_float=True)
    for i, out in enumerate(outs):
        for cb in (raw, floats, pairs):
            cb.on_train_batch_end(None, None, out, None, i)
    assert raw.losses == [np.float32(0.5), np.float32(0.25)] and type(raw.losses[0]) is np.float32
    assert floats.losses == [0.5, 0.25] and type(floats.losses[0]) is float
    assert pairs.losses == [(1.5, 0.5), (2.0, 0.25)]


def test_losses_hook_never_reads_its_batch():
    # jaxlight gives hooks that never read `batch` the loader's host arrays (tests/test_host_loop.py relies on
    # callbacks not changing that): the shared recorder must stay one of those
    from jaxlight.hooks import reads_argument

    assert reads_argument(Losses().on_train_batch_end, 3) is False
    assert reads_argument(SignalAt(1).on_train_batch_end, 3) is False


def test_signal_at_fires_once_at_its_micro_batch(monkeypatch):
    sent = []
    monkeypatch.setattr("os.kill", lambda pid, sig: sent.append(sig))
    cb = SignalAt(2, signal.SIGUSR1)
    for n in (1, 2, 3):
        trainer = types.SimpleNamespace(position=types.SimpleNamespace(micro_batches=n))
        cb.on_train_batch_end(trainer, None, {}, None, n - 1)
    assert sent == [signal.SIGUSR1]


def test_free_port_can_be_bound(tmp_path):
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("localhost", port))  # raises if it were taken


def test_wait_for_files_returns_once_they_exist_and_names_the_missing_ones(tmp_path):
    there = tmp_path / "there"
    there.write_text("x")
    wait_for_files([there], timeout=1.0)
    with pytest.raises(pytest.fail.Exception, match="missing"):
        wait_for_files([there, tmp_path / "missing"], timeout=0.2)


def test_host_params_and_record_copy_the_train_state_to_the_host():
    params = {"net/w": jnp.arange(4.0), "net/b": jnp.zeros(2)}
    trainer = types.SimpleNamespace(train_state=types.SimpleNamespace(params=params))
    got = host_params(trainer)
    assert got.keys() == params.keys() and all(type(v) is np.ndarray for v in got.values())
    np.testing.assert_array_equal(got["net/w"], [0.0, 1.0, 2.0, 3.0])
    rec = Record()
    rec.on_fit_start(trainer, None)
    assert rec.start_params.keys() == params.keys() and type(rec.start_params["net/w"]) is np.ndarray
    assert rec.start_shardings == {k: v.sharding for k, v in params.items()}
    rec.on_train_batch_end(trainer, None, {"loss": params["net/w"][1]}, None, 0)
    assert len(rec.losses) == 1 and float(rec.losses[0]) == 1.0  # kept as given (a device scalar)
