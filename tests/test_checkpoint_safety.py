"""Checkpoints are safe to open: no pickle on the save or load path.

Restores run with every unpickling entry point disabled (``tests.checkpoint_safety_common.no_pickle``) and
still resume bit-identically; values of every supported type come back with their exact type; values that
cannot be stored fail at save time naming their key path; old pickled checkpoints, crafted payloads and
malformed metadata are refused with a ``CheckpointError`` naming the file, and no payload ever runs.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import yaml

import jaxlight as jl
from jaxlight import serialization
from tests.checkpoint_models import DropoutClassifier, arrays, host_params, stateful_loader
from tests.checkpoint_safety_common import RichState, TypedHparams, no_pickle, rich_state, same
from tests.helpers import free_port, quiet

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_STEPS = 10  # accumulate 2, 8 batches per epoch: 20 micro-batches, 2.5 epochs


# checkpointing and sanity validation left to the Trainer's defaults
_quiet = functools.partial(quiet, enable_checkpointing=None, num_sanity_val_steps=None)


def _data(n: int = 32):
    x, y = arrays(n)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, n, 8)]


def _payload(target: pathlib.Path) -> bytes:
    """A pickle that creates ``target`` when unpickled (what a malicious checkpoint would carry)."""

    class CreatesFile:
        def __reduce__(self):
            return (open, (str(target), "w"))

    return pickle.dumps(CreatesFile())


def _rewrite_meta(ckpt: pathlib.Path, edit) -> None:
    f = ckpt / "meta" / "metadata"
    meta = json.loads(f.read_text())
    edit(meta)
    f.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A short fit of a module with typed hparams, saved with trainer.save_checkpoint."""
    d = tmp_path_factory.mktemp("safety")
    module = TypedHparams(schedule={0: 1.0, 10: 0.1})
    t = jl.Trainer(max_steps=2, enable_checkpointing=False, callbacks=[RichState()], **_quiet())
    t.fit(module, stateful_loader(n=32))
    path = d / "model.ckpt"
    t.save_checkpoint(str(path))
    return path, host_params(t), dict(module.hparams)


# ---------------------------------------------------------------------------- the encoding
@pytest.mark.parametrize("inline", [True, False], ids=["inline-arrays", "orbax-arrays"])
def test_tagged_json_round_trips_every_supported_type_exactly(inline):
    value = {"state": rich_state(5), "nested": [rich_state(6), (rich_state(7),)]}
    side: dict[str, np.ndarray] | None = None if inline else {}
    data = serialization.encode(value, root="checkpoint", arrays=side)
    text = json.dumps(data, allow_nan=False)  # standard JSON: no NaN/Infinity literals
    assert text == json.dumps(serialization.encode(value, root="checkpoint", arrays=None if inline else {}))
    if inline:
        assert not serialization.array_refs(json.loads(text))
    else:  # arrays over 64 KiB went to the side table (one per rich state), smaller ones stayed inline
        refs = serialization.array_refs(json.loads(text))
        assert refs.keys() == side.keys() and len(side) == 3
        assert all(side[k].dtype == dt and side[k].shape == shape for k, (dt, shape) in refs.items())
        assert all(a.nbytes > serialization.INLINE_ARRAY_BYTES for a in side.values())
    with no_pickle():
        back = serialization.decode(json.loads(text), load_array=lambda ref, dt, shape, path: side[ref])
    same(back, value)


def test_unsupported_values_name_their_key_path_and_type():
    with pytest.raises(serialization.EncodeError) as e:
        serialization.encode({"a": [1, {"fn": lambda x: x}]}, root="checkpoint")
    assert e.value.path == "checkpoint['a'][1]['fn']" and e.value.type_name == "function"
    assert "supported types: None, bool, int" in str(e.value)
    with pytest.raises(serialization.EncodeError, match=r"\['arr'\] has type numpy.ndarray of dtype object"):
        serialization.encode({"arr": np.array([object()])})
    loop: list = []
    loop.append(loop)
    with pytest.raises(serialization.EncodeError, match="reference cycle"):
        serialization.encode(loop)


@pytest.mark.parametrize(
    "text,problem",
    [
        ('{"__type__": "pickle", "data": "gASV"}', "unknown type tag 'pickle'"),
        ('{"x": {"__type__": "numpy.ndarray", "dtype": "object", "shape": [1], "data": ""}}', "dtype 'object'"),
        ('{"__type__": "numpy.ndarray", "dtype": "uint8", "shape": [4], "data": "AAA="}', "2 bytes of data"),
        ('{"__type__": "bytes", "base64": "%%%"}', "invalid base64"),
        ('{"__type__": "tuple", "items": [], "code": "x"}', "malformed 'tuple'"),
        ('{"__type__": "dict", "items": [[[1], 2]]}', "unhashable"),
        ('{"__type__": "numpy.dtype", "name": "float32", "as": "os.system"}', "'as' must be"),
        ('{"__type__": "torch.dtype", "name": "__class__"}', "torch has no dtype"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply|not valid JSON"),
    ],
)
def test_malformed_tagged_json_is_refused_with_its_path(text, problem):
    with no_pickle(), pytest.raises(serialization.DecodeError, match=problem):
        serialization.loads(text, root="meta")


def test_loader_state_gather_is_json_and_exact():
    """The cross-process gather (one process here) sends the loader state as tagged JSON, not a pickle."""
    loader = stateful_loader()
    it = iter(loader)
    next(it)
    state = {**loader.state_dict(), "_jaxlight_generator_state": loader.generator.get_state()}
    with no_pickle():
        (back,) = jl.checkpoint._gather_per_process(state)
    same(back, state)


# ---------------------------------------------------------------------------- resume without pickle
def _trainer(dirpath, callbacks, **kw) -> jl.Trainer:
    ckpt = jl.callbacks.ModelCheckpoint(dirpath=str(dirpath), every_n_train_steps=3, save_top_k=-1)
    return jl.Trainer(max_steps=MAX_STEPS, accumulate_grad_batches=2, callbacks=[*callbacks, ckpt], **_quiet(**kw))


def _ema(trainer, ema) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in ema.ema_params(trainer).items()}


def test_resume_with_pickle_disabled_is_bit_identical(tmp_path):
    """Shuffled StatefulDataLoader, Adam, EMA and a callback with rich state: resumed from the mid-epoch
    checkpoint at step 6 with pickle disabled, the run ends bit-identical to the uninterrupted one."""
    ema, rich = jl.callbacks.EMA(decay=0.9), RichState()
    ref = _trainer(tmp_path / "ref", [rich, ema])
    ref.fit(DropoutClassifier(), stateful_loader())
    want_params, want_ema = host_params(ref), _ema(ref, ema)
    (path,) = (tmp_path / "ref").glob("*-step=6.ckpt")

    meta_text = (path / "meta" / "metadata").read_text()
    meta = json.loads(meta_text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert meta["format_version"] == jl.checkpoint.FORMAT_VERSION == 2 and "host" not in meta
    assert meta["micro_batches"] == 12 and meta["batches_in_epoch"] == 4  # epoch 1, mid-epoch
    # the loader's generator states (5 KB torch tensors) are inlined; the callback's 80 KB array is in orbax
    assert meta["host_arrays"] == 1 and (path / "host_arrays").is_dir()
    assert "_jaxlight_generator_state" in meta_text and '"__type__": "torch.Tensor"' in meta_text

    ema2, rich2 = jl.callbacks.EMA(decay=0.9), RichState()
    t = _trainer(tmp_path / "run", [rich2, ema2])
    with no_pickle():
        t.fit(DropoutClassifier(), stateful_loader(), ckpt_path=str(path))
    same(rich2.loaded, rich_state(12))  # every type came back as itself
    same(rich2.extra_loaded, ("added by on_save_checkpoint", np.float16(0.5), b"\x00"))
    assert rich2.count == rich.count == 2 * MAX_STEPS
    got_params, got_ema = host_params(t), _ema(t, ema2)
    for k in want_params:
        np.testing.assert_array_equal(got_params[k], want_params[k], err_msg=k)
        np.testing.assert_array_equal(got_ema[k], want_ema[k], err_msg=f"ema {k}")


def test_load_from_checkpoint_and_validate_without_pickle(saved, tmp_path):
    path, params, hparams = saved
    with no_pickle():
        m = TypedHparams.load_from_checkpoint(str(path))
        t = jl.Trainer(**_quiet())
        fresh = TypedHparams()
        t.validate(fresh, _data(), ckpt_path=str(path), verbose=False)
    same(dict(m.hparams), hparams)  # the tuple, the jnp dtype, the Path and the int-keyed dict
    np.testing.assert_array_equal(np.asarray(m.net.l1.kernel[...]), params["net/l1/kernel"])
    np.testing.assert_array_equal(np.asarray(fresh.net.l2.kernel[...]), params["net/l2/kernel"])
    # a readable copy of the hparams, as plain YAML
    hp = yaml.safe_load((path / "hparams" / "hparams.yaml").read_text())
    assert hp["widths"] == [16, 8] and hp["lr"] == 0.01 and hp["data_dir"] == "/data"
    assert hp["schedule"] == {0: 1.0, 10: 0.1}


# ---------------------------------------------------------------------------- save-time errors
class ActModule(DropoutClassifier):
    def __init__(self, act=None, hidden: int = 16, ignore_act: bool = False) -> None:
        jl.LightningModule.__init__(self)
        self.save_hyperparameters(ignore=["act"] if ignore_act else [])
        self.hparams.update(din=8, dout=4, dropout=0.2, lr=1e-2)
        self.act = act


def _relu(x):
    return x * (x > 0)


def test_unstorable_hparam_fails_at_save_naming_it(tmp_path):
    t = jl.Trainer(max_steps=1, enable_checkpointing=False, **_quiet())
    t.fit(ActModule(act=_relu), _data())
    path = tmp_path / "a.ckpt"
    with pytest.raises(jl.CheckpointError) as e:
        t.save_checkpoint(str(path))
    msg = str(e.value)
    assert "checkpoint['hyper_parameters']['act'] has type function" in msg
    assert "self.save_hyperparameters(ignore=['act'])" in msg and "load_from_checkpoint(path, act=...)" in msg
    assert "Supported types: None, bool, int" in msg
    assert not path.exists()  # nothing written
    # the way out the message points to
    t = jl.Trainer(max_steps=1, enable_checkpointing=False, **_quiet())
    t.fit(ActModule(act=_relu, ignore_act=True), _data())
    t.save_checkpoint(str(path))
    with no_pickle():
        m = ActModule.load_from_checkpoint(str(path), act=_relu)
    assert m.act is _relu and "act" not in m.hparams and m.hparams.ignore_act is True


class BadState(jl.Callback):
    def state_dict(self):
        return {"ok": 1, "lock": threading.Lock()}


class ExtraInHook(DropoutClassifier):
    def on_save_checkpoint(self, checkpoint):
        checkpoint["mine"] = {"ok": (1, 2), "event": threading.Event()}


@pytest.mark.parametrize(
    "module,callbacks,where,advice",
    [
        (DropoutClassifier, [BadState()], "checkpoint['callbacks']['BadState']['lock']", "state_dict()"),
        (ExtraInHook, [], "checkpoint['mine']['event']", "on_save_checkpoint"),
    ],
)
def test_unstorable_state_fails_at_save_during_fit(module, callbacks, where, advice, tmp_path):
    ck = jl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=1)
    t = jl.Trainer(max_steps=2, callbacks=[*callbacks, ck], **_quiet())
    with pytest.raises(jl.CheckpointError) as e:
        t.fit(module(), _data())
    assert f"{where} has type " in str(e.value) and advice in str(e.value)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())  # nothing written


# ---------------------------------------------------------------------------- hostile and broken files
def _copy(saved_path: pathlib.Path, tmp_path: pathlib.Path, name: str = "copy.ckpt") -> pathlib.Path:
    dst = tmp_path / "ck" / name
    shutil.copytree(saved_path, dst)
    return dst


def _every_load(path: pathlib.Path, match: str) -> None:
    """load_from_checkpoint, fit(ckpt_path=path), validate(ckpt_path=path) all refuse with ``match``."""
    with pytest.raises(jl.CheckpointError, match=match):
        TypedHparams.load_from_checkpoint(str(path))
    t = jl.Trainer(max_steps=3, enable_checkpointing=False, **_quiet())
    with pytest.raises(jl.CheckpointError, match=match):
        t.fit(TypedHparams(), _data(), ckpt_path=str(path))
    with pytest.raises(jl.CheckpointError, match=match):
        jl.Trainer(**_quiet()).validate(TypedHparams(), _data(), ckpt_path=str(path), verbose=False)


def test_old_pickled_checkpoint_is_refused_without_unpickling(saved, tmp_path):
    """A format-1 checkpoint (host state pickled) carrying a payload: refused, with pickle *enabled*."""
    target = tmp_path / "pwned"
    path = _copy(saved[0], tmp_path)

    def to_v1(meta):
        meta["format_version"] = 1
        del meta["host_state"], meta["host_arrays"]
        meta["host"] = base64.b64encode(_payload(target)).decode("ascii")

    _rewrite_meta(path, to_v1)
    _every_load(path, r"written by an older jaxlight \(format version 1\).*pickle.*not loaded")
    # "last" finds it (its facts are plain JSON) and refuses it the same way, instead of "no checkpoint"
    t = jl.Trainer(max_steps=3, callbacks=[jl.callbacks.ModelCheckpoint(dirpath=str(path.parent))], **_quiet())
    with pytest.raises(jl.CheckpointError, match="older jaxlight"):
        t.fit(TypedHparams(), _data(), ckpt_path="last")
    assert jl.checkpoint.read_meta(path)["global_step"] == 2
    assert not target.exists()


def test_crafted_payloads_never_run(saved, tmp_path):
    target = tmp_path / "pwned"
    payload = base64.b64encode(_payload(target)).decode("ascii")

    # a pickled "host" field next to valid JSON host state is ignored
    ignored = _copy(saved[0], tmp_path, "ignored.ckpt")
    _rewrite_meta(ignored, lambda m: m.update(host=payload))
    m = TypedHparams.load_from_checkpoint(str(ignored))
    np.testing.assert_array_equal(np.asarray(m.net.l1.kernel[...]), saved[1]["net/l1/kernel"])

    # payloads inside the tagged JSON: under a made-up tag, or as the bytes of an object array
    for name, value, match in (
        ("tag.ckpt", {"__type__": "pickle", "data": payload}, "unknown type tag 'pickle'"),
        ("object.ckpt", {"__type__": "numpy.ndarray", "dtype": "object", "shape": [1], "data": payload}, "object"),
        ("reduce.ckpt", {"__type__": "numpy.scalar", "dtype": "float32", "value": {"__reduce__": payload}}, "value"),
    ):
        path = _copy(saved[0], tmp_path, name)
        _rewrite_meta(path, lambda m, v=value: m["host_state"]["hyper_parameters"].update(lr=v))
        _every_load(path, rf"metadata .*{re.escape(str(path))}/meta/metadata is malformed at .*{match}")

    # the metadata file itself replaced by a pickle
    path = _copy(saved[0], tmp_path, "pickled_meta.ckpt")
    (path / "meta" / "metadata").write_bytes(_payload(target))
    _every_load(path, r"metadata .*pickled_meta.ckpt/meta/metadata is not (UTF-8|valid JSON)")
    assert not target.exists()


@pytest.mark.parametrize(
    "damage,match",
    [
        ("truncate", r"meta/metadata is not valid JSON \(truncated or corrupt\?\)"),
        ("not_jaxlight", r"meta/metadata is not jaxlight checkpoint metadata"),
        ("bad_step", r"meta/metadata is malformed: checkpoint\['global_step'\] should be an int >= 0, got str"),
        ("bad_loop", r"meta/metadata is malformed: checkpoint\['loops'\]\['fit_loop'\] should be a dict"),
        ("newer", r"format version 3; this jaxlight reads version 2"),
        ("no_host_arrays", r"missing \['host_arrays'\]"),
        ("bad_ref", r"host arrays do not match the metadata"),
    ],
)
def test_damaged_metadata_gets_a_checkpoint_error_naming_the_file(saved, tmp_path, damage, match):
    path = _copy(saved[0], tmp_path)
    f = path / "meta" / "metadata"
    if damage == "truncate":
        f.write_text(f.read_text()[: len(f.read_text()) // 2])
    elif damage == "not_jaxlight":
        f.write_text('{"hello": 1}')
    elif damage == "bad_step":
        _rewrite_meta(path, lambda m: m["host_state"].update(global_step="2"))
    elif damage == "bad_loop":
        _rewrite_meta(path, lambda m: m["host_state"]["loops"].update(fit_loop=[1]))
    elif damage == "newer":
        _rewrite_meta(path, lambda m: m.update(format_version=3))
    elif damage == "no_host_arrays":
        shutil.rmtree(path / "host_arrays")
    else:  # an array reference whose shape disagrees with the stored array

        def edit(m):
            def first_ref(x):
                if isinstance(x, dict):
                    return x if "ref" in x else next(filter(None, map(first_ref, x.values())), None)
                return next(filter(None, map(first_ref, x)), None) if isinstance(x, list) else None

            first_ref(m["host_state"])["shape"] = [7]

        _rewrite_meta(path, edit)
    with no_pickle():
        _every_load(path, match)


# ---------------------------------------------------------------------------- the documented way to read one
def test_docs_read_a_checkpoint_with_orbax_and_json_alone(saved, tmp_path):
    """The docs/checkpointing.md snippet runs in a fresh interpreter that never imports jaxlight."""
    path, params, _ = saved
    text = (ROOT / "docs" / "checkpointing.md").read_text()
    block = re.search(r"<!-- read-without-jaxlight -->\s*```python\n(.*?)```", text, flags=re.S).group(1)
    assert 'path = "checkpoints/last.ckpt"' in block
    code = block.replace('path = "checkpoints/last.ckpt"', f"path = {str(path)!r}") + (
        "\nimport sys\nassert 'jaxlight' not in sys.modules and 'torch' not in sys.modules\n"
        f"np.savez({str(tmp_path / 'out.npz')!r}, **{{'p/' + k: v for k, v in model['params'].items()}},"
        " generator=loader_state['_jaxlight_generator_state'])\n"
        f"open({str(tmp_path / 'hp.json')!r}, 'w').write(json.dumps(hparams))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    for k, v in params.items():
        np.testing.assert_array_equal(out["p/" + k], v, err_msg=k)
    ckpt = jl.checkpoint.host_checkpoint(jl.checkpoint.read_meta(path))
    gen = ckpt["loops"]["fit_loop"]["loader_state"]["_jaxlight_generator_state"]
    np.testing.assert_array_equal(out["generator"], gen.numpy())
    hp = json.loads((tmp_path / "hp.json").read_text())
    assert hp["widths"] == {"__type__": "tuple", "items": [16, 8]} and hp["lr"] == 0.01


# ---------------------------------------------------------------------------- several processes
@pytest.mark.slow
def test_two_processes_resume_without_pickle_bit_identical(tmp_path):
    """Two jax.distributed processes, each with its own shuffled StatefulDataLoader (process_local_batches),
    Adam, EMA and a stateful callback: the loader states are gathered as JSON; resuming from a mid-run
    checkpoint with pickle disabled in both workers ends bit-identical to the uninterrupted run."""
    from tests.test_checkpoint_preemption import Proc

    worker = os.path.join(ROOT, "tests", "checkpoint_safety_worker.py")

    def pair(out, **opts):
        port = str(free_port())
        procs = [Proc([worker, str(i), "2", port, str(out), json.dumps(opts)]) for i in range(2)]
        rcs = [p.finish() for p in procs]
        assert rcs == [0, 0], [p.output()[-3000:] for p in procs]
        return procs

    pair(tmp_path / "ref")
    (path,) = (tmp_path / "ref" / "ckpts").glob("*-step=4.ckpt")
    states = jl.checkpoint.host_checkpoint(jl.checkpoint.read_meta(path))["loops"]["fit_loop"][
        "loader_states_by_process"
    ]
    assert len(states) == 2 and serialization.dumps(states[0]) != serialization.dumps(states[1])
    procs = pair(tmp_path / "run", ckpt_path=str(path))
    assert all("PICKLE DISABLED" in p.output() for p in procs)
    want, got = np.load(tmp_path / "ref" / "final.npz"), np.load(tmp_path / "run" / "final.npz")
    assert set(want.files) == set(got.files) and any(k.startswith("ema/") for k in want.files)
    for k in want.files:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
