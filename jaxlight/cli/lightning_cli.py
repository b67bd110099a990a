"""``LightningCLI``: Lightning's config-driven entry point for training scripts, on jsonargparse.

``python train.py fit --config cfg.yaml --trainer.max_steps 100 --model.lr 1e-3``.
Arguments come from the type hints of the Trainer, the LightningModule and
the LightningDataModule ``__init__``; callbacks, loggers and strategy pieces
are given by class path. jsonargparse is imported only when a LightningCLI is
built (``pip install "jaxlight[cli]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import inspect
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Union

from jaxlight import distributed
from jaxlight.callbacks.callback import Callback
from jaxlight.config import ARGUMENTS
from jaxlight.datamodule import LightningDataModule
from jaxlight.module import LightningModule
from jaxlight.trainer import Trainer

if TYPE_CHECKING:  # pragma: no cover
    from jsonargparse import ArgumentParser, Namespace


def _strategy_type() -> Any:
    """What ``--trainer.strategy`` accepts: a registered name ("fsdp+tp"), one piece or strategy by
    class path, or a list of pieces that are composed with ``+`` (each with its own init args)."""
    from jaxlight.strategies import Piece, Strategy

    return Union[str, Piece, Strategy, list[Piece]]  # noqa: UP007 - a runtime type for jsonargparse


_PARSER_CLASS: type | None = None


def _parser_class() -> type:
    """:class:`LightningArgumentParser`, built on first use so jsonargparse is imported only then."""
    global _PARSER_CLASS
    if _PARSER_CLASS is not None:
        return _PARSER_CLASS
    from jaxlight.integrations import require

    require("jsonargparse", "LightningCLI")  # missing or too old: one message with the pip command
    import jsonargparse

    from jaxlight.strategies import Piece

    # Strategy pieces are frozen dataclasses, which jsonargparse treats as closed types unless told
    # otherwise; `--trainer.strategy jaxlight.strategies.FSDP` needs their subclasses accepted.
    jsonargparse.set_parsing_settings(subclasses_enabled=[Piece])

    class LightningArgumentParser(jsonargparse.ArgumentParser):
        """jsonargparse's ArgumentParser with Lightning's helpers.

        Prefixes of option names are not accepted (``--trainer.max_epoch`` is an error, not
        ``--trainer.max_epochs``), and an unknown option's error names the closest known ones.
        """

        def __init__(
            self,
            *args: Any,
            description: str = "jaxlight Trainer command line tool",
            env_prefix: str = "JAXLIGHT",
            default_env: bool = False,
            **kwargs: Any,
        ) -> None:
            kwargs.setdefault("allow_abbrev", False)
            super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
            self.callback_keys: list[str] = []

        def add_lightning_class_args(
            self,
            lightning_class: type | Callable[..., Any],
            nested_key: str,
            subclass_mode: bool = False,
            required: bool = True,
        ) -> list[str]:
            """Add the ``__init__`` arguments of a Trainer, LightningModule, LightningDataModule or
            Callback class under ``--<nested_key>.*``; returns the names added.

            A Callback added this way is appended to the trainer's callbacks
            (``add_lightning_class_args(EarlyStopping, "early_stopping")``).
            With ``subclass_mode`` any subclass is accepted by class path.
            """
            if callable(lightning_class) and not isinstance(lightning_class, type):
                lightning_class = jsonargparse.class_from_function(lightning_class)
            bases = (Trainer, LightningModule, LightningDataModule, Callback)
            if not (isinstance(lightning_class, type) and issubclass(lightning_class, bases)):
                raise ValueError(
                    f"cannot add arguments from {lightning_class!r}: give a callable or a subclass of Trainer, "
                    "LightningModule, LightningDataModule or Callback"
                )
            if issubclass(lightning_class, Callback):
                self.callback_keys.append(nested_key)
            if subclass_mode:
                return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
            if issubclass(lightning_class, Trainer):
                return self._add_trainer_args(lightning_class, nested_key)
            return self.add_class_arguments(
                lightning_class, nested_key, fail_untyped=False, instantiate=True, sub_configs=True
            )

        def _add_trainer_args(self, trainer_class: type, nested_key: str) -> list[str]:
            params = inspect.signature(trainer_class.__init__).parameters
            # The Trainer's own annotation of `strategy` does not admit pieces by class path
            # nor a list of them; the CLI declares the argument itself.
            skip = {"strategy"} if "strategy" in params else set()
            added = self.add_class_arguments(
                trainer_class, nested_key, fail_untyped=False, instantiate=False, sub_configs=True, skip=skip
            )
            if skip:
                default = params["strategy"].default
                self.add_argument(
                    f"--{nested_key}.strategy",
                    type=_strategy_type(),
                    default="auto" if default is inspect.Parameter.empty else default,
                    help="a name ('ddp', 'fsdp', 'fsdp+tp', ...), a jaxlight.strategies piece or Strategy by "
                    "class path (--trainer.strategy jaxlight.strategies.FSDP --trainer.strategy.min_shard 4096), "
                    "or a list of pieces composed with + (in a config file)",
                )
                added = [*added, f"{nested_key}.strategy"]
            # An argument whose "not given" differs from its default (val_check_interval: None, so that
            # check_val_every_n_epoch=None alone is accepted) is not given unless the command line says so.
            unset = {f"{nested_key}.{a.name}": a.not_given for a in ARGUMENTS if a.not_given is not a.default}
            unset = {key: value for key, value in unset.items() if key in added}
            if unset:
                self.set_defaults(unset)
            return added

        def error(self, message: str, ex: Exception | None = None) -> Any:
            return super().error(_with_suggestions(self, message), ex)

    LightningArgumentParser.__module__ = __name__
    LightningArgumentParser.__qualname__ = "LightningArgumentParser"
    _PARSER_CLASS = LightningArgumentParser
    return LightningArgumentParser


def __getattr__(name: str) -> Any:  # PEP 562: `from jaxlight.cli.lightning_cli import LightningArgumentParser`
    if name == "LightningArgumentParser":
        return _parser_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _options(parser: Any) -> list[str]:
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def _subcommand_parsers(parser: Any) -> dict[str, Any]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _with_suggestions(parser: Any, message: str) -> str:
    """Append hints for unknown options (command line) and unknown keys (config files): an option that
    belongs after the subcommand, or the closest known names."""
    unknown = re.findall(r"(--[A-Za-z0-9_.\-]+)", message) if "nrecognized arguments" in message else []
    keys = re.findall(r"[Kk]ey ['\"]([A-Za-z0-9_.\-]+)['\"] is not expected", message)
    keys += re.findall(r"does not accept (?:option|key) ['\"]([A-Za-z0-9_.\-]+)['\"]", message)
    unknown += ["--" + k for k in keys]
    if not unknown:
        return message
    subs = _subcommand_parsers(parser)
    known = list(dict.fromkeys([*_options(parser), *(o for p in subs.values() for o in _options(p))]))
    hints = []
    for opt in dict.fromkeys(o.split("=")[0] for o in unknown):
        owners = [name for name, p in subs.items() if opt in _options(p)]
        if owners and opt not in _options(parser):
            hints.append(f"{opt} is an option of the subcommands {', '.join(owners)}: give it after the subcommand")
            continue
        close = difflib.get_close_matches(opt, known, n=3, cutoff=0.75)
        if close:
            hints.append(f"{opt}: did you mean {' or '.join(close)}?")
    return message + ("\n" + "\n".join(hints) if hints else "")


@contextlib.contextmanager
def _benign_dump_warnings_off():
    """Silence jsonargparse's note that an empty tuple is dumped as ``[]``: for the strategy pieces' ``rules``
    (whose postponed annotations jsonargparse does not resolve) the list parses back to the same piece."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s)\s*Dump of a value that does not round-trip.*Value: \(\)\s*$")
        yield


def _short_description(fn: Any) -> str | None:
    doc = inspect.getdoc(fn)
    return doc.strip().split("\n")[0].rstrip(".") if doc else None


class SaveConfigCallback(Callback):
    """Writes the parsed config of a LightningCLI run to ``<trainer.log_dir>/config.yaml`` at setup.

    As Lightning's: the file is written once, by process 0, before any training; an existing file
    is an error (``RuntimeError``, raised on every process) unless ``overwrite=True``, so the
    config of an earlier run in the same log dir is never replaced. ``save_config`` is a hook
    for saving it elsewhere too (called on process 0 only). Running the saved file with
    ``--config`` reproduces the run, including the seed that ``seed_everything: true`` drew.
    """

    def __init__(
        self,
        parser: ArgumentParser,
        config: Namespace,
        config_filename: str = "config.yaml",
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
    ) -> None:
        self.parser = parser
        self.config = config
        self.config_filename = config_filename
        self.overwrite = overwrite
        self.multifile = multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError(
                "save_to_log_dir=False only makes sense in a SaveConfigCallback subclass that implements save_config"
            )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            log_dir = trainer.log_dir
            path = os.path.join(log_dir, self.config_filename)
            if not self.overwrite:
                exists = distributed.broadcast_int(int(trainer.is_global_zero and os.path.isfile(path)))
                if exists:
                    raise RuntimeError(
                        f"{type(self).__name__} expected {path} to not exist: it holds the config of an earlier run. "
                        "Delete it, choose another log dir (--trainer.default_root_dir or the logger's save_dir/"
                        "version), set LightningCLI(save_config_kwargs={'overwrite': True}) to replace it, or "
                        "LightningCLI(save_config_callback=None) to save no config."
                    )
            if trainer.is_global_zero:
                os.makedirs(log_dir, exist_ok=True)
                with _benign_dump_warnings_off():
                    self.parser.save(
                        self.config, path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile
                    )
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
        self.already_saved = True

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Override to also save the config elsewhere (e.g. ``trainer.logger.log_hyperparams``); process 0 only."""


SUBCOMMAND_SKIP: dict[str, set[str]] = {
    "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
    "validate": {"model", "dataloaders", "datamodule"},
    "test": {"model", "dataloaders", "datamodule"},
    "predict": {"model", "dataloaders", "datamodule"},
}


class LightningCLI:
    """Lightning's ``LightningCLI``: build a Trainer, a module and a datamodule from a config and run one
    Trainer method.

    ``python train.py {fit,validate,test,predict} [--config cfg.yaml] [--print_config]
    [--seed_everything N] [--trainer.*] [--model.*] [--data.*] [--ckpt_path ...]``

    Guarantees, as in Lightning:

    - Every argument comes from a type hint: the Trainer's ``__init__``, ``model_class`` and
      ``datamodule_class`` ``__init__`` (``--model.lr 1e-3``), and the subcommand's own Trainer
      method arguments (``fit --ckpt_path last``). Callbacks, loggers and strategies are given by class
      path with their init args (``--trainer.callbacks+=jaxlight.callbacks.EarlyStopping
      --trainer.callbacks.monitor val_loss``); ``--trainer.strategy`` also takes a list of pieces that
      are composed with ``+``.
    - Values are checked while parsing: an unknown or mistyped option, a value of the wrong type, an
      unknown class path or strategy name exits with status 2 and a message naming the option (and the
      closest known names), before anything is built. Config files are read with YAML's safe loader,
      and class paths in them may only name subclasses of the annotated types.
    - Later sources override earlier ones: defaults, ``trainer_defaults``, ``--config`` files in
      order, then command-line options in order. ``--print_config`` prints the merged config and exits.
    - ``seed_everything`` (default ``seed_everything_default=True``: a random seed, the same on every
      process) is applied before any class is built and recorded in the config; ``False`` seeds nothing.
    - ``save_config_callback`` writes the config to ``<log_dir>/config.yaml`` (not with ``fast_dev_run``).
    - ``trainer_defaults`` changes Trainer defaults; its ``callbacks`` are always added, after the
      configured ones, and are not configurable.
    - With ``run=False`` there are no subcommands: ``cli.trainer``, ``cli.model`` and ``cli.datamodule``
      are built and the script calls the Trainer itself.
    - Multi-process runs: :func:`jaxlight.distributed.initialize` is called after parsing and before
      anything is built, so a script started by ``jaxlight launch``, ``srun`` or a Kubernetes Job joins
      its run without code.

    Subclass hooks: ``add_arguments_to_parser(parser)`` (extra arguments, ``parser.link_arguments``,
    ``parser.add_lightning_class_args``), ``before_instantiate_classes``, ``after_instantiate_classes``,
    ``before_<subcommand>`` / ``after_<subcommand>``, a method named like a subcommand replaces the
    Trainer's. Not supported from Lightning: ``auto_configure_optimizers`` (optax optimizers are built in
    ``configure_optimizers``) and ``load_from_checkpoint_support``.
    """

    def __init__(
        self,
        model_class: type[LightningModule] | Callable[..., LightningModule] | None = None,
        datamodule_class: type[LightningDataModule] | Callable[..., LightningDataModule] | None = None,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: type[Trainer] | Callable[..., Trainer] = Trainer,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        parser_class: type | None = None,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: Sequence[str] | dict[str, Any] | Namespace | None = None,
        run: bool = True,
    ) -> None:
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class or _parser_class()
        self.model_class = model_class
        self._model_class = model_class or LightningModule
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class = datamodule_class
        self._datamodule_class = datamodule_class or LightningDataModule
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data

        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in self.subcommands()}
        sub_kwargs = {k: v for k, v in self.parser_kwargs.items() if k in self.subcommands()}
        self.setup_parser(run, main_kwargs, sub_kwargs)
        self.parse_arguments(self.parser, args)
        self.subcommand: str | None = self.config["subcommand"] if run else None

        distributed.initialize()  # a no-op unless a launcher, srun or a Job set the environment
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ parser
    def init_parser(self, **kwargs: Any) -> ArgumentParser:
        """The parser (one per subcommand), with ``-c/--config``."""
        from jsonargparse import ActionConfigFile

        import jaxlight

        kwargs.setdefault("dump_header", [f"jaxlight=={jaxlight.__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument(
            "-c", "--config", action=ActionConfigFile, help="a YAML or JSON config file (may be given several times)"
        )
        return parser

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        self.parser = self.init_parser(**main_kwargs)
        if add_subcommands:
            self._subcommand_method_arguments: dict[str, list[str]] = {}
            self._add_subcommands(self.parser, **subparser_kwargs)
        else:
            self._add_arguments(self.parser)

    def add_default_arguments_to_parser(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--seed_everything",
            type=Union[bool, int],  # noqa: UP007 - a runtime type for jsonargparse
            default=self.seed_everything_default,
            help="an int seeds Python, NumPy (and torch) before the classes are built; true draws a random seed "
            "(recorded in the saved config); false seeds nothing",
        )

    def add_core_arguments_to_parser(self, parser: ArgumentParser) -> None:
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        if defaults:
            parser.set_defaults(defaults)
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        # without a datamodule class the data is optional: the module may define its own dataloaders
        parser.add_lightning_class_args(
            self._datamodule_class,
            "data",
            subclass_mode=self.subclass_mode_data,
            required=self.datamodule_class is not None,
        )

    def _add_arguments(self, parser: ArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)

    def add_arguments_to_parser(self, parser: ArgumentParser) -> None:
        """Override to add arguments, link arguments (``parser.link_arguments("data.seq_len",
        "model.seq_len")``) or configurable callbacks (``parser.add_lightning_class_args``)."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands (Trainer methods) and the method arguments the CLI fills itself."""
        return SUBCOMMAND_SKIP

    def _trainer_type(self) -> type:
        if isinstance(self.trainer_class, type):
            return self.trainer_class
        from jsonargparse import class_from_function

        return class_from_function(self.trainer_class)

    def _add_subcommands(self, parser: ArgumentParser, **kwargs: Any) -> None:
        self._subcommand_parsers: dict[str, ArgumentParser] = {}
        subcommands = parser.add_subcommands()
        trainer_type = self._trainer_type()
        for name, skip in self.subcommands().items():
            description = _short_description(getattr(trainer_type, name))
            sub_kwargs = dict(kwargs.get(name, {}))
            sub_kwargs.setdefault("description", description)
            sub = self.init_parser(**sub_kwargs)
            self._add_arguments(sub)
            self._subcommand_method_arguments[name] = sub.add_method_arguments(trainer_type, name, skip=set(skip))
            self._subcommand_parsers[name] = sub
            subcommands.add_subcommand(name, sub, help=description)

    def _parser(self, subcommand: str | None) -> ArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    def parse_arguments(self, parser: ArgumentParser, args: Sequence[str] | dict[str, Any] | Namespace | None) -> None:
        """Parse ``args`` (``sys.argv[1:]`` when None; a dict or Namespace is a structured config) into
        ``self.config``; exits with status 2 and a message on any invalid value."""
        from jsonargparse import Namespace

        with _benign_dump_warnings_off():  # --print_config dumps while parsing
            if isinstance(args, (dict, Namespace)):
                self.config = parser.parse_object(args)
            else:
                self.config = parser.parse_args(args)
        self._check_strategy()

    def _check_strategy(self) -> None:
        """A strategy name is a plain string to the parser: resolve it now, so a typo fails at parse time."""
        from jaxlight.strategies import resolve_strategy

        sub = self.config.get("subcommand")
        cfg = self.config.get(sub, self.config) if sub else self.config
        strategy = cfg.get("trainer.strategy") if "trainer" in cfg else None
        if isinstance(strategy, str):
            try:
                resolve_strategy(strategy)
            except (ValueError, TypeError) as e:
                self._parser(sub).error(f'Parser key "trainer.strategy": {e}')

    # ------------------------------------------------------------------ seeding
    def _set_seed(self) -> None:
        from jaxlight.seed import seed_everything

        seed = self._get(self.config, "seed_everything")
        if seed is None or seed is False:
            return
        if seed is True:
            env = os.environ.get("PL_GLOBAL_SEED")
            # every process must draw the same seed: process 0's is broadcast
            seed = (
                int(env) if env is not None else distributed.broadcast_int(int.from_bytes(os.urandom(4), "little") >> 1)
            )
        seed = seed_everything(int(seed), workers=True)
        if self.subcommand:
            self.config[self.subcommand]["seed_everything"] = seed
        else:
            self.config["seed_everything"] = seed

    # ------------------------------------------------------------------ instantiation
    def _get(self, config: Any, key: str, default: Any = None) -> Any:
        """``key`` of ``config``, looked up inside the subcommand's part when there is one."""
        return config.get(str(self.subcommand), config).get(key, default)

    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are built."""

    def _instantiate(self, parser: ArgumentParser, config: Any) -> Any:
        # `instantiate` replaced `instantiate_classes` in jsonargparse 4.49
        fn = getattr(parser, "instantiate", None) or parser.instantiate_classes
        return fn(config)

    def instantiate_classes(self) -> None:
        """Build the model, the datamodule and the trainer from ``self.config``."""
        self.config_init = self._instantiate(self.parser, self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self.trainer = self.instantiate_trainer()

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are built."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Build the trainer from the config; ``kwargs`` override config values."""
        extra = [self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys]
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        config = {k: _plain(v) for k, v in vars(trainer_cfg).items()}
        config.update(kwargs)
        return self._instantiate_trainer(config, extra)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        from jaxlight.strategies import Strategy

        if isinstance(config.get("strategy"), list):  # pieces composed in the order given
            config["strategy"] = Strategy(*config["strategy"]) if config["strategy"] else "auto"
        if "callbacks" in config:
            cbs = config["callbacks"]
            cbs = [] if cbs is None else list(cbs) if isinstance(cbs, (list, tuple)) else [cbs]
            cbs.extend(callbacks)
            value = self.trainer_defaults.get("callbacks")
            if value is not None:
                cbs.extend(value if isinstance(value, (list, tuple)) else [value])
            if self.save_config_callback and not config.get("fast_dev_run", False):
                cbs.append(
                    self.save_config_callback(
                        self._parser(self.subcommand),
                        self.config.get(str(self.subcommand), self.config),
                        **self.save_config_kwargs,
                    )
                )
            config["callbacks"] = cbs
        return self.trainer_class(**config)

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        fn = getattr(self, subcommand, getattr(self.trainer, subcommand))
        fn(**self._prepare_subcommand_kwargs(subcommand))
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        cfg = self.config_init[subcommand]
        kwargs = {k: cfg[k] for k in self._subcommand_method_arguments[subcommand] if k in cfg}
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        return kwargs


def _plain(value: Any) -> Any:
    """jsonargparse Namespaces (nested groups) as dicts; everything else unchanged."""
    from jsonargparse import Namespace

    return value.as_dict() if isinstance(value, Namespace) else value


__all__ = ["LightningArgumentParser", "LightningCLI", "SaveConfigCallback"]  # noqa: F822 (module __getattr__)
