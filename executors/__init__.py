"""Executors carry plans out as copies between GPU blocks and the pinned CPU tier.

They never decide what to move (that is `kvferry.core`'s job), and importing this package
imports no GPU framework: `torch` and `cupy` load only when their executor is made. Nor does it
need the optional compiled module `_native`: the GPU executors use it where it is built and
plain Python otherwise (`kvferry.executors.jobcode`).
"""

from kvferry.executors.base import CopyPath, Executor
from kvferry.executors.host import HostTier, split_pieces
from kvferry.executors.registry import (
    BUILTIN_EXECUTORS,
    ENTRY_POINT_GROUP,
    ExecutorEntry,
    executor_class,
    executor_entries,
    make_executor,
    register_executor,
)
from kvferry.executors.tensors import (
    KVCacheEntry,
    KVPages,
    KVTensor,
    RegisteredTensor,
    TensorGeometry,
    tensor_geometry,
)

__all__ = [
    "BUILTIN_EXECUTORS",
    "ENTRY_POINT_GROUP",
    "CopyPath",
    "Executor",
    "ExecutorEntry",
    "HostTier",
    "KVCacheEntry",
    "KVPages",
    "KVTensor",
    "RegisteredTensor",
    "TensorGeometry",
    "executor_class",
    "executor_entries",
    "make_executor",
    "register_executor",
    "split_pieces",
    "tensor_geometry",
]
