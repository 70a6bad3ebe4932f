"""The scenario format, read as strictly as the configuration: every field present where it must
be, of its kind and in its range, no unknown field, and bounded, so that a malformed or hostile
scenario is refused with InvalidInputError naming the field's path before any planning starts.

Pure: bytes or a parsed document in; `kvferry plan` and the golden tests do the I/O. The tables
below are the format: a new field is one entry.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from kvferry.core.codec import SCHEMA_VERSION, config_to_dict
from kvferry.core.config import GroupKind, GroupSpec, OffloadConfig
from kvferry.core.errors import InvalidInputError, member_named
from kvferry.core.json_input import JsonObject, parse_json

MAX_SCENARIO_BYTES = 16 << 20
"""Largest scenario file read (16 MiB: the golden scenarios are a few KiB)."""
MAX_HASH_BLOCKS = 1 << 16
"""Most hash blocks a scenario's request may have (`num_tokens // hash_block_size`, or the
length of `block_hashes`): keys are made for each, so this bounds the memory a scenario takes."""
MAX_GROUPS = 64
"""Most KV-cache groups a scenario's configuration may have."""
MAX_STEPS = 1 << 10
"""Most planning steps a scenario may have."""

_TOP_FIELDS = ("schema_version", "description", "config", "request", "tier", "steps")
_REQUEST_FIELDS = ("request_id", "num_tokens", "num_prompt_tokens", "block_hashes", "store_loaded")
_TIER_FIELDS = ("ready", "pending", "free_rows")
_STEP_FIELDS = {
    "lookup": ("op", "num_computed_tokens"),
    "load": ("op", "num_computed_tokens", "blocks", "hit_tokens"),
    "store": ("op", "num_computed_tokens", "num_scheduled_tokens", "blocks", "num_tokens"),
}
_SAMPLE_CONFIG = OffloadConfig(
    hash_block_size=1,
    blocks_per_chunk=1,
    groups=(GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=1, sliding_window=1),),
)
# The codec writes every field it reads: its output names the configuration's fields.
_CONFIG_FIELDS = tuple(config_to_dict(_SAMPLE_CONFIG))
_GROUP_FIELDS = tuple(config_to_dict(_SAMPLE_CONFIG)["groups"][0])
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+", re.ASCII)
_GROUP_INDEX = re.compile(r"0|[1-9][0-9]{0,5}", re.ASCII)
_CACHED_BLOCK = re.compile(r"c(?:0|[1-9][0-9]{0,18})", re.ASCII)


def parse_scenario(data: bytes | bytearray | memoryview | str) -> dict[str, Any]:
    """Return the scenario document in `data` (UTF-8 JSON, at most MAX_SCENARIO_BYTES), checked
    by `check_scenario`; raise InvalidInputError naming the field's path otherwise."""
    document = parse_json(data, field="scenario", max_bytes=MAX_SCENARIO_BYTES)
    check_scenario(document)
    result: dict[str, Any] = document
    return result


def check_scenario(document: object) -> None:
    """Raise InvalidInputError, naming the field's path (`steps[2].num_computed_tokens`), what
    it must be and what it is, unless `document` is a well-formed scenario within the bounds."""
    if not isinstance(document, dict):
        raise InvalidInputError(field="scenario", expected="a JSON object", got=document)
    top = JsonObject(document)
    top.only(_TOP_FIELDS)
    version = top.get("schema_version", int)
    if version != SCHEMA_VERSION:
        raise top.refuse("schema_version", str(SCHEMA_VERSION), version)
    top.optional("description", "", str)
    hash_block_size, num_groups = _check_config(top.child("config"))
    request = top.child("request")
    _check_request(request, hash_block_size)
    if "tier" in top.document:
        _check_tier(top.child("tier"), num_groups)
    steps = top.children("steps")
    if len(steps) > MAX_STEPS:
        raise top.refuse("steps", f"at most {MAX_STEPS} steps", f"{len(steps)} steps")
    for step in steps:
        _check_step(step, num_groups)


def _check_config(config: JsonObject) -> tuple[int, int]:
    """Check the configuration's fields; return its hash block size and group count."""
    config.only(_CONFIG_FIELDS)
    hash_block_size = config.count("hash_block_size", low=1)
    config.count("blocks_per_chunk", low=1)
    config.optional("store_decoded_tokens", True, bool)
    groups = config.children("groups")
    if not 1 <= len(groups) <= MAX_GROUPS:
        raise config.refuse("groups", f"1 to {MAX_GROUPS} groups", f"{len(groups)} groups")
    for group in groups:
        group.only(_GROUP_FIELDS)
        with group.building():
            member_named(GroupKind, group.get("kind", str), field="kind")
        group.count("block_size", low=1)
        window = group.optional("sliding_window", None, int, type(None))
        if window is not None and window < 1:
            raise group.refuse("sliding_window", "an integer >= 1, or null", window)
    return hash_block_size, len(groups)


def _check_request(request: JsonObject, hash_block_size: int) -> None:
    request.only(_REQUEST_FIELDS)
    request.optional("request_id", "", str)
    num_tokens = request.count("num_tokens")
    request.count("num_prompt_tokens", default=num_tokens)
    request.optional("store_loaded", False, bool)
    hashes = request.optional("block_hashes", None, list)
    if hashes is None:
        if num_tokens // hash_block_size > MAX_HASH_BLOCKS:
            raise request.refuse(
                "num_tokens",
                f"at most {MAX_HASH_BLOCKS} hash blocks of {hash_block_size} tokens "
                f"({MAX_HASH_BLOCKS * hash_block_size + hash_block_size - 1} tokens)",
                num_tokens,
            )
        return
    if len(hashes) > MAX_HASH_BLOCKS:
        raise request.refuse(
            "block_hashes", f"at most {MAX_HASH_BLOCKS} hashes", f"{len(hashes)} hashes"
        )
    for index, text in enumerate(hashes):
        name = f"block_hashes[{index}]"
        if not isinstance(text, str) or not _HEX.fullmatch(text):
            raise request.refuse(name, "a hash written in hex, two digits a byte", text)


def _check_tier(tier: JsonObject, num_groups: int) -> None:
    tier.only(_TIER_FIELDS)
    free_rows = tier.optional("free_rows", None, int, type(None))
    if free_rows is not None and free_rows < 0:
        raise tier.refuse("free_rows", "an integer >= 0, or null (no cap)", free_rows)
    for name in ("ready", "pending"):
        if name not in tier.document:
            continue
        by_group = tier.child(name)
        for group_text in by_group.document:
            if not _GROUP_INDEX.fullmatch(group_text) or int(group_text) >= num_groups:
                raise by_group.refuse(
                    group_text, f"a group index in [0, {num_groups}) as the key", group_text
                )
            for chunk_index, chunk in enumerate(by_group.integers(group_text)):
                if chunk < 0:
                    raise by_group.refuse(
                        f"{group_text}[{chunk_index}]", "a chunk index >= 0", chunk
                    )


def _check_step(step: JsonObject, num_groups: int) -> None:
    op = step.get("op", str)
    fields = _STEP_FIELDS.get(op)
    if fields is None:
        raise step.refuse("op", "one of " + ", ".join(map(repr, _STEP_FIELDS)), op)
    step.only(fields)
    for name, check in _STEP_CHECKS.items():
        if name in fields:
            check(step, name, num_groups)


def _required_count(step: JsonObject, name: str, num_groups: int) -> None:
    step.count(name)


def _optional_count(step: JsonObject, name: str, num_groups: int) -> None:
    if name in step.document:
        step.count(name)


def _block_lists(step: JsonObject, name: str, num_groups: int) -> None:
    lists = step.get(name, list)
    if len(lists) != num_groups:
        raise step.refuse(name, f"{num_groups} block lists, one per group", f"{len(lists)} lists")
    for group, entries in enumerate(lists):
        where = f"{name}[{group}]"
        step.check(where, entries, list)
        for index, entry in enumerate(entries):
            if not _is_block_entry(entry):
                raise step.refuse(
                    f"{where}[{index}]",
                    "a block id >= 0, null (the null block), or 'c<id>' (a GPU-cached block)",
                    entry,
                )


def _is_block_entry(entry: object) -> bool:
    if entry is None:
        return True
    if isinstance(entry, str):
        return _CACHED_BLOCK.fullmatch(entry) is not None
    return isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0


_STEP_CHECKS: Mapping[str, Callable[[JsonObject, str, int], None]] = {
    "num_computed_tokens": _required_count,
    "num_scheduled_tokens": _required_count,
    "hit_tokens": _optional_count,
    "num_tokens": _optional_count,
    "blocks": _block_lists,
}
