"""The Trainer's arguments are written once (jaxlight.config.ARGUMENTS): the signature, TrainerConfig, the
attributes (checked on assignment), the LightningCLI's options and docs/trainer.md's table all come from it."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import typing
from pathlib import Path

import pytest

import jaxlight as jl
from jaxlight.config import ARGUMENT, ARGUMENTS, CONFIG_ARGUMENTS, TrainerConfig, markdown_table
from jaxlight.errors import MisconfigurationError
from tests.core_models import Classifier, batches, make_data, quiet

DOCS = Path(__file__).resolve().parent.parent / "docs" / "trainer.md"


def _trainer(**kw) -> jl.Trainer:
    return jl.Trainer(**quiet(**kw))


def _error(fn) -> str:
    with pytest.raises((MisconfigurationError, ValueError)) as info:
        fn()
    return str(info.value)


# ---------------------------------------------------------------------------- the signature
def test_the_signature_is_the_table_in_its_order_with_its_defaults_and_types():
    params = inspect.signature(jl.Trainer).parameters
    assert list(params) == [a.name for a in ARGUMENTS]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    for a in ARGUMENTS:
        assert params[a.name].default == a.default, a.name
        if a.type is not None:
            assert params[a.name].annotation == a.type, a.name
    hints = typing.get_type_hints(jl.Trainer.__init__)  # what jsonargparse resolves: every name real
    assert set(hints) == {*params, "return"}
    assert hints["callbacks"] == jl.Callback | typing.Sequence[jl.Callback] | None or "Callback" in str(
        hints["callbacks"]
    )


def test_the_documented_defaults_show_in_the_signature_and_in_help():
    params = inspect.signature(jl.Trainer).parameters
    shown = {n: params[n].default for n in ("num_sanity_val_steps", "log_every_n_steps", "val_check_interval")}
    assert shown == {"num_sanity_val_steps": 2, "log_every_n_steps": 50, "val_check_interval": 1.0}
    text = pydoc.render_doc(jl.Trainer, renderer=pydoc.plaintext)
    assert "num_sanity_val_steps: int | None = 2" in text and "log_every_n_steps: int | None = 50" in text
    assert "val_check_interval: int | float | None = 1.0" in text
    # every argument's meaning is in the docstring help() prints (and jsonargparse reads)
    doc = inspect.getdoc(jl.Trainer.__init__)
    assert all(f"    {a.name}: " in doc for a in ARGUMENTS)


def test_none_still_means_the_documented_default():
    explicit = TrainerConfig.from_arguments(num_sanity_val_steps=None, log_every_n_steps=None, logger=False)
    default = TrainerConfig.from_arguments(logger=False)
    for name, value in (("num_sanity_val_steps", 2), ("log_every_n_steps", 50), ("val_check_interval", 1.0)):
        assert getattr(explicit, name) == getattr(default, name) == value, name


def test_val_check_interval_not_given_is_not_the_same_as_given():
    # not given (or None): check_val_every_n_epoch=None counts epoch-lengths of batches; an explicit float is
    # a fraction of an epoch there and refused, as in Lightning (this is why "not given" is tracked)
    assert TrainerConfig.from_arguments(check_val_every_n_epoch=None, logger=False).val_check_interval == 1.0
    TrainerConfig.from_arguments(check_val_every_n_epoch=None, val_check_interval=None, logger=False)
    message = _error(lambda: TrainerConfig.from_arguments(check_val_every_n_epoch=None, val_check_interval=1.0))
    assert "val_check_interval=1.0 is a fraction of an epoch" in message


def test_every_argument_is_checked_as_given_even_where_fast_dev_run_replaces_it():
    # one check per argument, run on the value passed: fast_dev_run's overrides do not hide a bad one
    assert "max_steps must be -1 (no limit) or >= 0, got -5" in _error(
        lambda: jl.Trainer(fast_dev_run=True, max_steps=-5)
    )
    config = TrainerConfig.from_arguments(fast_dev_run=2, max_steps=100, limit_val_batches=0.5, logger=True)
    assert (config.max_steps, config.limit_val_batches, config.loggers) == (2, 2, ())


def test_an_unknown_argument_is_a_type_error_naming_the_closest():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_step'; did you mean 'max_steps'\?"):
        jl.Trainer(max_step=3)
    with pytest.raises(TypeError):
        jl.Trainer(1)  # keyword-only, as before


# ---------------------------------------------------------------------------- TrainerConfig and attributes
def test_config_fields_and_trainer_attributes_come_from_the_table():
    assert [f.name for f in dataclasses.fields(TrainerConfig)] == [a.config_field for a in CONFIG_ARGUMENTS]
    trainer = _trainer(max_steps=4, limit_val_batches=0.5)
    for a in ARGUMENTS:
        if a.field is None or a.attribute is None:
            continue
        value = getattr(trainer.config, a.config_field)
        assert getattr(trainer, a.attribute or a.name) is value, a.name
    assert trainer.max_steps == 4 and trainer.limit_val_batches == 0.5 and trainer.precision == "32-true"


BAD = [
    ("max_steps", -5),
    ("max_steps", "10"),
    ("max_epochs", -2),
    ("min_epochs", -1),
    ("min_steps", -1),
    ("num_sanity_val_steps", -3),
    ("log_every_n_steps", 0),
    ("check_val_every_n_epoch", 0),
    ("val_check_interval", 1.5),
    ("val_check_interval", 0),
    ("val_check_interval", "0.5"),
    ("limit_val_batches", 2.0),
    ("limit_train_batches", -1),
    ("limit_test_batches", True),
    ("limit_predict_batches", 1.5),
    ("accumulate_grad_batches", 0),
    ("gradient_clip_val", -1.0),
    ("gradient_clip_algorithm", "l3"),
    ("ragged_batches", "pad"),
    ("prefetch", -1),
    ("steps_per_execution", 0),
    ("process_local_batches", "no"),
    ("enable_checkpointing", "no"),
    ("enable_model_summary", 1),
    ("seed", "1"),
    ("default_root_dir", 3),
    ("fast_dev_run", -1),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_assignment_raises_what_the_argument_raises(name, value):
    expected = _error(lambda: jl.Trainer(**{name: value}))
    assert repr(value) in expected or str(value) in expected  # the error names the number
    trainer = _trainer()
    before = trainer.config
    assert _error(lambda: setattr(trainer, name, value)) == expected
    assert trainer.config is before  # a refused value changes nothing


def test_every_checked_attribute_is_covered_above():
    checked = {a.name for a in CONFIG_ARGUMENTS if a.check is not None and a.attribute is not None}
    assert checked - {name for name, _ in BAD} == {"deterministic"}  # its check refuses only on GPU


def test_assignment_resolves_as_the_argument_does():
    trainer = _trainer(max_steps=5)
    trainer.log_every_n_steps = None
    trainer.num_sanity_val_steps = None
    trainer.fast_dev_run = True
    trainer.enable_checkpointing = None
    trainer.max_epochs = None  # max_steps bounds the run: no epoch limit
    config = trainer.config
    assert (config.log_every_n_steps, config.num_sanity_val_steps, config.fast_dev_run) == (50, 2, 1)
    assert config.enable_checkpointing is True and config.max_epochs == -1
    trainer.max_steps = -1
    trainer.max_epochs = None  # now nothing else does: Lightning's 1000
    assert trainer.max_epochs == 1000
    trainer.precision_plugin = "bf16-mixed"
    assert trainer.precision == "bf16-mixed"


def test_assignment_checks_the_validation_cadence_together():
    message = _error(lambda: jl.Trainer(check_val_every_n_epoch=None, val_check_interval=0.5))
    across = _trainer(check_val_every_n_epoch=None)
    assert _error(lambda: setattr(across, "val_check_interval", 0.5)) == message
    across.val_check_interval = 8  # an int counts batches across epochs
    fraction = _trainer(val_check_interval=0.5)
    assert "val_check_interval=0.5 is a fraction of an epoch" in _error(
        lambda: setattr(fraction, "check_val_every_n_epoch", None)
    )
    plain = _trainer()
    plain.check_val_every_n_epoch = None  # the default interval (1.0), as Trainer(check_val_every_n_epoch=None)
    assert plain.check_val_every_n_epoch is None and plain.val_check_interval == 1.0


# ---------------------------------------------------------------------------- one copy: the loops read it
class _ShortenRun(jl.Callback):
    """Assigns the run's length from a hook, as a user callback would."""

    def on_train_start(self, trainer, pl_module):
        trainer.max_steps = 3


def test_an_assignment_during_fit_reaches_the_loop():
    x, y = make_data(128)
    trainer = _trainer(max_steps=10, max_epochs=None, callbacks=[_ShortenRun()])
    trainer.fit(Classifier(), batches(x, y, 16))
    assert trainer.global_step == 3 and trainer.config.max_steps == 3


# ---------------------------------------------------------------------------- the CLI and the docs
def test_the_cli_reads_the_table():
    pytest.importorskip("jsonargparse")
    from jaxlight.cli import LightningCLI

    args = ["--trainer.check_val_every_n_epoch=null", "--trainer.logger=false", "--trainer.max_steps=3"]
    cli = LightningCLI(jl.LightningModule, run=False, args=args, save_config_callback=None)
    # not given on the command line: not given to the Trainer (None), so check_val_every_n_epoch=None is accepted
    assert cli.config.trainer.val_check_interval is None and cli.trainer.val_check_interval == 1.0
    assert cli.config.trainer.num_sanity_val_steps == 2 and cli.config.trainer.log_every_n_steps == 50
    assert cli.trainer.max_steps == 3 and cli.trainer.check_val_every_n_epoch is None
    parser = cli.parser
    options = {s for action in parser._actions for s in action.option_strings}
    assert {f"--trainer.{a.name}" for a in ARGUMENTS} <= options
    help_of = {s: action.help for action in parser._actions for s in action.option_strings}
    assert ARGUMENT["max_steps"].doc.replace("`", "") in help_of["--trainer.max_steps"]


def test_the_docs_table_is_the_table():
    text = DOCS.read_text()
    assert markdown_table() in text, "docs/trainer.md's argument table differs: paste config.markdown_table()"
