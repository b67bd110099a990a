"""Every private API jaxlight relies on (all of them behind jaxlight/compat.py) still exists in the
installed jax and orbax: a move in either library fails here, by name, instead of silently elsewhere."""

import jax
import orbax.checkpoint as ocp

from jaxlight import compat


def test_backends_initialized_reads_jax():
    jax.devices()  # starts the CPU backend
    assert compat.backends_initialized() is True


def test_distributed_client_absent_in_a_single_process():
    assert compat.distributed_client() is None
    assert jax.distributed.is_initialized() is False


def test_cluster_environments_found():
    envs = compat.cluster_environments()
    names = {e.__name__ for e in envs}
    assert "SlurmCluster" in names, names
    assert all(callable(getattr(e, "is_env_present", None)) for e in envs)


def test_compilation_cache_private_attributes_exist():
    cc = compat._compilation_cache_module()  # raises CompatError naming the missing attribute
    assert hasattr(cc._cache_initialized_mutex, "__enter__")


def test_async_save_in_flight_sees_orbax_thread(tmp_path):
    import numpy as np

    ck = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    assert hasattr(ck, "_async_manager"), "orbax AsyncCheckpointer._async_manager moved"
    ck.save(tmp_path / "c", args=ocp.args.StandardSave({"a": np.arange(4)}))
    ck.wait_until_finished()
    assert compat.async_save_in_flight(ck) is False
    mgr = ck._async_manager
    assert hasattr(mgr, "_thread"), "orbax AsyncCheckpointer._async_manager._thread moved"
    ck.close()
