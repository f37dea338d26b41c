"""A segmentation fault in XLA's Shardy partitioner (jax 0.11.2, fixed in 0.12.0.1; see
runner/row_update.py).

Inside ``shard_map``, ``zeros.at[:n].set(y)`` where ``n`` is the whole (local) row count crashes
the compile; one row fewer compiles. The DP step avoids the full-size update (``set_rows``).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python scripts/repro_shardy_full_update.py part    # prints the result
    ... python scripts/repro_shardy_full_update.py full    # segmentation fault
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

full = (sys.argv[1:] or ["part"])[0] == "full"
mesh = Mesh(np.asarray(jax.devices()[:2]), ("dp",))


def body(prev, x):
    y = jnp.argmax(x, -1).astype(jnp.int32)
    n = prev.shape[0] if full else prev.shape[0] - 1
    return jnp.zeros_like(prev).at[:n].set(y[:n])


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp"), check_vma=False))
print("full" if full else "part", f(jnp.zeros((8,), jnp.int32), jnp.ones((8, 5))))
