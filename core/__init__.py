"""kvferry's planning core: pure values and functions that decide what to move, never how.

This package does no I/O, reads no clock, draws no random number, keeps no global state, and
imports only the standard library, attrs and numpy (never torch or cupy). The caller reads and
writes files, asks the CPU tier, and runs the copies; every function here takes what it needs as
arguments and returns new immutable values, so the same inputs give the same plan, byte for byte.
"""

from kvferry.core.blocks import GroupBlocks
from kvferry.core.bound import BoundPlan, JobResult
from kvferry.core.catalog import (
    Catalog,
    CatalogConfig,
    CatalogCounters,
    CatalogEntry,
    CatalogEvent,
    CatalogView,
    EventKind,
    KeyState,
    Reservation,
    rows_for_budget,
)
from kvferry.core.codec import SCHEMA_VERSION, plan_from_json, plan_to_json
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import (
    ExecutorUnavailableError,
    InvalidInputError,
    KvferryError,
    PlanInvariantError,
    TransferFailedError,
    UnknownExecutorError,
)
from kvferry.core.eviction import EvictionPolicy, EvictionPolicyKind, make_policy
from kvferry.core.expand import CopyList, PageCopies, copy_list, expand_pages
from kvferry.core.group_rows import FoundRows
from kvferry.core.keys import HashStatusView, KeyChain, KeyStatus, KeyStatusView, OffloadKey
from kvferry.core.kinds import KIND_RULES, KindRule
from kvferry.core.layout import GroupLayout, KVLayout, PageRef, TensorLayout, describe_tensor
from kvferry.core.load import plan_load
from kvferry.core.lookup import LookupResult, lookup
from kvferry.core.plan import Direction, TransferPlan
from kvferry.core.state import RequestState, extend_keys, new_request_state
from kvferry.core.store import (
    StoreDecision,
    StoreOutcome,
    StoreTierView,
    due_for_store,
    plan_store,
    store_due,
    stored_tokens_after_step,
)

__all__ = [
    "KIND_RULES",
    "SCHEMA_VERSION",
    "BoundPlan",
    "Catalog",
    "CatalogConfig",
    "CatalogCounters",
    "CatalogEntry",
    "CatalogEvent",
    "CatalogView",
    "CopyList",
    "Direction",
    "EventKind",
    "EvictionPolicy",
    "EvictionPolicyKind",
    "ExecutorUnavailableError",
    "FoundRows",
    "GroupBlocks",
    "GroupKind",
    "GroupLayout",
    "GroupSpec",
    "HashStatusView",
    "InvalidInputError",
    "JobResult",
    "KVLayout",
    "KeyChain",
    "KeyState",
    "KeyStatus",
    "KeyStatusView",
    "KindRule",
    "KvferryError",
    "LookupResult",
    "OffloadConfig",
    "OffloadKey",
    "PageCopies",
    "PageRef",
    "PlanInvariantError",
    "RequestState",
    "Reservation",
    "StoreDecision",
    "StoreOutcome",
    "StoreTierView",
    "TensorLayout",
    "TransferFailedError",
    "TransferPlan",
    "UnknownExecutorError",
    "copy_list",
    "describe_tensor",
    "due_for_store",
    "expand_pages",
    "extend_keys",
    "lookup",
    "make_policy",
    "new_request_state",
    "plan_from_json",
    "plan_load",
    "plan_store",
    "plan_to_json",
    "rows_for_budget",
    "store_due",
    "stored_tokens_after_step",
]
