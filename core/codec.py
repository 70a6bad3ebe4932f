"""Plans and planner inputs to and from plain JSON-ready dictionaries (and canonical text).

Pure: no files are read or written here; the caller does the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvferry.core.blocks import GroupBlocks
from kvferry.core.canonical_json import dumps_canonical
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError
from kvferry.core.keys import OffloadKey
from kvferry.core.kinds import PARAMETER_DEFAULTS
from kvferry.core.plan import Direction, TransferPlan

SCHEMA_VERSION = 1
"""Bumped whenever a serialised field changes meaning or shape."""


def key_to_text(key: OffloadKey) -> str:
    """Return a key as `g<group>:<hash hex>`, e.g. `g1:0000000c`."""
    return str(key)


def key_from_text(text: str) -> OffloadKey:
    """Return the key written as `g<group>:<hash hex>`."""
    try:
        group, digest = text.split(":", 1)
        if not group.startswith("g"):
            raise ValueError(text)
        return OffloadKey(int(group[1:]), bytes.fromhex(digest))
    except (ValueError, AttributeError) as exc:
        raise InvalidInputError(
            field="keys", expected="a key written as 'g<group>:<hex>'", got=text
        ) from exc


def check_schema_version(document: Mapping[str, Any]) -> None:
    """Raise InvalidInputError unless `document` carries this library's schema version."""
    version = document.get("schema_version")
    if version != SCHEMA_VERSION:
        raise InvalidInputError(field="schema_version", expected=str(SCHEMA_VERSION), got=version)


def _require(document: Mapping[str, Any], field: str, kind: type | tuple[type, ...]) -> Any:
    if field not in document:
        raise InvalidInputError(field=field, expected="a value", got="nothing")
    value = document[field]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidInputError(field=field, expected=f"a {kind}", got=value)
    return value


def plan_to_dict(plan: TransferPlan) -> dict[str, Any]:
    """Return the plan as a JSON-ready dictionary (keys readable, a `schema_version`)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "request_id": plan.request_id,
        "direction": plan.direction.value,
        "blocks_per_chunk": plan.blocks_per_chunk,
        "keys": [key_to_text(k) for k in plan.keys],
        "gpu_block_ids": plan.gpu_block_ids.tolist(),
        "group_sizes": list(plan.group_sizes),
        "block_indices": list(plan.block_indices),
    }


def plan_from_dict(document: Mapping[str, Any]) -> TransferPlan:
    """Return the plan a `plan_to_dict` dictionary describes (validated like any plan)."""
    check_schema_version(document)
    direction_name = _require(document, "direction", str)  # raises before the try: no KeyError
    try:
        direction = Direction(direction_name)
    except ValueError as exc:
        raise InvalidInputError(
            field="direction", expected="'load' or 'store'", got=direction_name
        ) from exc
    return TransferPlan(
        request_id=_require(document, "request_id", str),
        direction=direction,
        blocks_per_chunk=_require(document, "blocks_per_chunk", int),
        keys=tuple(key_from_text(k) for k in _require(document, "keys", list)),
        gpu_block_ids=_require(document, "gpu_block_ids", list),
        group_sizes=_require(document, "group_sizes", list),
        block_indices=_require(document, "block_indices", list),
    )


def plan_to_json(plan: TransferPlan) -> str:
    """Return the plan as canonical JSON text."""
    return dumps_canonical(plan_to_dict(plan))


def plan_from_json(text: str) -> TransferPlan:
    """Return the plan written by `plan_to_json`."""
    return plan_from_dict(parse_object(text))


def parse_object(text: str) -> Mapping[str, Any]:
    """Return the JSON object in `text`, or raise InvalidInputError."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(field="document", expected="JSON text", got=str(exc)) from exc
    if not isinstance(document, dict):
        raise InvalidInputError(field="document", expected="a JSON object", got=type(document))
    return document


def config_to_dict(config: OffloadConfig) -> dict[str, Any]:
    """Return the configuration as a JSON-ready dictionary."""
    groups = []
    for spec in config.groups:
        group: dict[str, Any] = {"kind": spec.kind.value, "block_size": spec.block_size}
        for name, default in PARAMETER_DEFAULTS.items():
            if getattr(spec, name) != default:
                group[name] = getattr(spec, name)
        groups.append(group)
    return {
        "hash_block_size": config.hash_block_size,
        "blocks_per_chunk": config.blocks_per_chunk,
        "store_decoded_tokens": config.store_decoded_tokens,
        "groups": groups,
    }


def config_from_dict(document: Mapping[str, Any]) -> OffloadConfig:
    """Return the configuration a `config_to_dict` dictionary describes."""
    groups = []
    for index, group in enumerate(_require(document, "groups", list)):
        try:
            kind = GroupKind(group["kind"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidInputError(
                group=index,
                field="kind",
                expected="one of " + ", ".join(k.value for k in GroupKind),
                got=group.get("kind") if isinstance(group, dict) else group,
            ) from exc
        parameters = {
            name: group.get(name, default) for name, default in PARAMETER_DEFAULTS.items()
        }
        groups.append(
            GroupSpec(kind=kind, block_size=_require(group, "block_size", int), **parameters)
        )
    return OffloadConfig(
        hash_block_size=_require(document, "hash_block_size", int),
        blocks_per_chunk=_require(document, "blocks_per_chunk", int),
        groups=tuple(groups),
        store_decoded_tokens=document.get("store_decoded_tokens", True),
    )


def blocks_to_list(blocks: GroupBlocks) -> list[Any]:
    """Return a block list in its readable form: an id, `null` for a null block, or
    `"c<id>"` for a GPU prefix-cache hit."""
    out: list[Any] = []
    for block_id, null, cached in zip(
        blocks.ids.tolist(), blocks.is_null.tolist(), blocks.is_cached.tolist(), strict=True
    ):
        out.append(None if null else f"c{block_id}" if cached else block_id)
    return out


def blocks_from_list(entries: Sequence[Any], *, null_block_id: int = 0) -> GroupBlocks:
    """Return the GroupBlocks a `blocks_to_list` list describes (nulls get `null_block_id`)."""
    ids, null, cached = [], [], []
    for index, entry in enumerate(entries):
        if entry is None:
            ids.append(null_block_id)
            null.append(index)
        elif isinstance(entry, str) and entry.startswith("c") and entry[1:].isdigit():
            ids.append(int(entry[1:]))
            cached.append(index)
        elif isinstance(entry, int) and not isinstance(entry, bool):
            ids.append(entry)
        else:
            raise InvalidInputError(
                field=f"blocks[{index}]",
                expected="a block id, null, or 'c<id>' for a GPU-cached block",
                got=entry,
            )
    return GroupBlocks.of(ids, null=null, cached=cached)


__all__ = [
    "SCHEMA_VERSION",
    "blocks_from_list",
    "blocks_to_list",
    "check_schema_version",
    "config_from_dict",
    "config_to_dict",
    "key_from_text",
    "key_to_text",
    "parse_object",
    "plan_from_dict",
    "plan_from_json",
    "plan_to_dict",
    "plan_to_json",
]
