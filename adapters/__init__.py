"""Engine-facing glue: the command line, configuration, engine-shaped facades.

Adapters may do I/O; they never hold planning rules (those live in `kvferry.core`).
`build_offloading` makes the executor, the CPU tier's catalog and the session of one process
from a planner configuration and the engine's KV tensors.
"""

from kvferry.adapters.offloading import Offloading, build_offloading

__all__ = ["Offloading", "build_offloading"]
