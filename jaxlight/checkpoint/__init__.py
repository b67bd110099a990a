"""Checkpoints of a whole run on orbax-checkpoint: save, find, restore, publish.

The package's layers, each importing only those above it:

- ``CheckpointError`` and ``Preempted`` live in :mod:`jaxlight.errors` (re-exported here);
- :mod:`~jaxlight.checkpoint.schema`: what the metadata may hold (every field
  jaxlight reads, its type and range), checked before anything is used;
- :mod:`~jaxlight.checkpoint.format`: the orbax items of a checkpoint, the one
  rule for "complete", the meta item, path-keyed trees of arrays and their
  restore into a template's shardings;
- :mod:`~jaxlight.checkpoint.host_state`: Lightning's checkpoint dict as
  tagged JSON (never pickled);
- :mod:`~jaxlight.checkpoint.discovery`: complete checkpoints in a directory,
  ``"last"`` and ``"best"``, asked of checkpoint callbacks through what
  :class:`~jaxlight.callbacks.Callback` declares, not their type;
- :mod:`~jaxlight.checkpoint.dirlock`: one live run per checkpoint directory
  (a lock file naming the run);
- :mod:`~jaxlight.checkpoint.publish`: crash-safe publication of committed
  saves (atomic rename/exchange, the publisher, repair after a kill);
- :mod:`~jaxlight.checkpoint.run_state`: a run's state as a value
  (:class:`RunSnapshot`: a pytree of the train state's arrays with the host
  dict beside it) and its I/O, ``save(contents, path)`` and
  ``restore(like, path)``, which take trees and know nothing of the Trainer;
- :mod:`~jaxlight.checkpoint.writer`: the mechanics of a checkpoint
  callback's saves (its directory lock, the publishing checkpointer, commit
  order, background errors);
- :mod:`~jaxlight.checkpoint.trainer_io`: the Trainer's side (the only module
  here that knows the Trainer): one function reads it (``view_of``), one
  writes a restored snapshot back (``apply_restored``);
- :mod:`~jaxlight.checkpoint.module_load`: ``load_from_checkpoint`` of a module.

No module of this package imports a callback: ``ModelCheckpoint`` (its policy:
when, which names, top-k, ``last``) imports from here, never the reverse.
"""

from __future__ import annotations

from jaxlight.checkpoint.discovery import (
    check_path,
    find_last,
    list_checkpoints,
)
from jaxlight.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    TMP_MARK,
    CheckpointMeta,
    is_complete,
    new_checkpointer,
    read_meta,
    save_in_flight,
)
from jaxlight.checkpoint.host_state import check_hparams, host_checkpoint
from jaxlight.checkpoint.module_load import load_module_from_checkpoint
from jaxlight.checkpoint.run_state import RunSnapshot, gather_loader_states, host_dict, read_host, restore, save
from jaxlight.checkpoint.trainer_io import (
    dump_checkpoint,
    find_last_checkpoint,
    no_last_checkpoint_reason,
    resolve_ckpt_path,
    restore_into_trainer,
    restore_logger_states,
    save_checkpoint,
    snapshot_of,
    view_of,
)
from jaxlight.errors import CheckpointError, Preempted

# the names these had when the package was one module (tests and benchmarks use them)
_new_checkpointer = new_checkpointer
_check_path = check_path
_gather_per_process = gather_loader_states

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "TMP_MARK",
    "CheckpointError",
    "CheckpointMeta",
    "Preempted",
    "RunSnapshot",
    "check_hparams",
    "check_path",
    "dump_checkpoint",
    "find_last",
    "find_last_checkpoint",
    "gather_loader_states",
    "host_checkpoint",
    "host_dict",
    "is_complete",
    "list_checkpoints",
    "load_module_from_checkpoint",
    "new_checkpointer",
    "no_last_checkpoint_reason",
    "read_host",
    "read_meta",
    "resolve_ckpt_path",
    "restore",
    "restore_into_trainer",
    "restore_logger_states",
    "save",
    "save_checkpoint",
    "save_in_flight",
    "snapshot_of",
    "view_of",
]
