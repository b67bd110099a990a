"""benchmarks/gpu_check.sh runs on a bare GPU image (jax, flax, optax, orbax, torch, transformers) without
torchdata, keras, mlflow or jsonargparse: jaxlight and every script it runs import without them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSENT = ("torchdata", "keras", "mlflow", "jsonargparse")

# Every finder is wrapped to answer None for the absent packages, as if they were not installed
# (importlib.util.find_spec returns None, an import raises ModuleNotFoundError).
PROGRAM = textwrap.dedent(
    f"""
    import sys
    ABSENT = {ABSENT!r}

    class Hide:
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ABSENT:
                return None
            f = getattr(self.inner, "find_spec", None)
            return f(name, path, target) if f else None

    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
    try:
        import mlflow  # noqa: F401
        print("HIDING FAILED")
    except ModuleNotFoundError:
        pass
    sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "benchmarks")!r}]
    import jaxlight, jaxlight.callbacks, jaxlight.loggers, examples.gpt  # noqa: E401,F401
    import attention_check, mfu, offload, peers  # noqa: E401,F401
    print("LOADED", sorted({{m.split(".")[0] for m in sys.modules}} & set(ABSENT)))
    """
)


def test_jaxlight_and_the_gpu_check_scripts_import_without_optional_packages():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "HIDING FAILED" not in res.stdout
    assert "LOADED []" in res.stdout, res.stdout
