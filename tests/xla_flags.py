"""XLA flags for every JAX process the tests start: simulated CPU devices and a cheaper CPU code generator.

Compiling is most of the suite's time (measured: 72 of 100 s in test_sequence_training). XLA:CPU's LLVM
optimisation level 0 with the older (non-"fusion emitter") kernel generator compiles about 4x faster; the
programs it runs are slower, but the tests' programs are small. Both flags change how XLA turns each HLO
fusion into machine code, not the HLO program: what the tests assert (placements, collectives, memory
figures, bit-identity between runs of one process or of processes started with these same flags) is
computed under one setting on both sides. The demo, the benchmarks and users keep XLA's defaults, and
tests/test_default_codegen.py reruns the central exactness checks under them.

Imported before jax by tests/conftest.py and by the worker scripts (this module imports no jax).
"""

from __future__ import annotations

import os

# Set to 1 to run the whole suite (workers included) under XLA's default code generator.
DEFAULT_CODEGEN_ENV = "JAXLIGHT_TESTS_DEFAULT_CODEGEN"
CHEAP_CPU_CODEGEN = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def cheap_codegen() -> bool:
    """Whether this run's processes use the cheap code generator (``$JAXLIGHT_TESTS_DEFAULT_CODEGEN`` is not 1)."""
    return os.environ.get(DEFAULT_CODEGEN_ENV) != "1"


def codegen_flags(cheap: bool | None = None) -> str:
    """The code generator part of :func:`cpu_xla_flags` alone ("" under XLA's defaults)."""
    if cheap is None:
        cheap = cheap_codegen()
    return " ".join(CHEAP_CPU_CODEGEN if cheap else ())


def cpu_xla_flags(devices: int, cheap: bool | None = None) -> str:
    """``XLA_FLAGS`` for a test process with ``devices`` simulated CPU devices and, unless ``cheap=False`` or
    ``$JAXLIGHT_TESTS_DEFAULT_CODEGEN=1``, the cheap code generator."""
    return f"--xla_force_host_platform_device_count={devices} {codegen_flags(cheap)}".strip()
