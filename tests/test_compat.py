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


def test_host_putter_gives_what_make_array_from_callback_gives():
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    for spec in (P(), P("a"), P("a", "b"), P(None, "b")):
        sh = NamedSharding(mesh, spec)
        put = compat.host_putter(x.shape, x.dtype, sh)
        assert put is not None, "jax._src.interpreters.pxla.batched_device_put or core.update_aval_with_sharding moved"
        got, want = put(x), jax.make_array_from_callback(x.shape, sh, x.__getitem__)
        assert got.sharding == want.sharding and got.aval == want.aval and got.committed == want.committed
        np.testing.assert_array_equal(np.asarray(got), x)
        for a, b in zip(got.addressable_shards, want.addressable_shards):
            assert a.device == b.device and a.index == b.index


def test_variable_value_setter_points_a_variable_at_a_new_array():
    import jax.numpy as jnp
    from flax import nnx

    setter = compat.variable_value_setter()
    v = nnx.Param(jnp.zeros(3))
    new = jnp.ones(3)
    setter(v, new)
    assert v.get_raw_value() is new
    assert setter is compat.variable_value_setter()  # made once
