"""`kvferry plan` on malformed scenario files: one clear line naming the field's path and exit
code 2, never a traceback, never a wrong meaning taken silently, and bounded memory."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest

from kvferry.adapters import cli
from kvferry.core.scenario_schema import MAX_SCENARIO_BYTES

BASE: dict[str, Any] = {
    "schema_version": 1,
    "description": "every field of the format",
    "config": {
        "hash_block_size": 4,
        "blocks_per_chunk": 1,
        "store_decoded_tokens": True,
        "groups": [
            {"kind": "full_attention", "block_size": 12},
            {"kind": "sliding_window", "block_size": 16, "sliding_window": 32},
            {"kind": "mamba", "block_size": 16},
        ],
    },
    "request": {
        "request_id": "r1",
        "num_tokens": 85,
        "num_prompt_tokens": 85,
        "store_loaded": False,
    },
    "tier": {
        "ready": {"0": [0, 1, 2, 3, 4, 5], "1": [0, 1, 2, 3, 4], "2": [0, 1, 2, 3, 4]},
        "pending": {},
        "free_rows": None,
    },
    "steps": [
        {"op": "lookup", "num_computed_tokens": 48},
        {
            "op": "load",
            "num_computed_tokens": 48,
            "hit_tokens": 16,
            "blocks": [
                ["c1", "c2", "c3", "c4", 15, 16],
                [None, "c21", "c22", 23],
                [None, None, "c32", 33],
            ],
        },
        {
            "op": "store",
            "num_computed_tokens": 64,
            "num_scheduled_tokens": 21,
            "num_tokens": 85,
            "blocks": [
                ["c1", "c2", "c3", "c4", 15, 16, 17],
                [None, None, "c22", 23, 24],
                [None, None, None, 33, 34],
            ],
        },
    ],
}


def plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes) -> tuple[int, str]:
    """Run `kvferry plan` on a file holding `data`; return its exit code and stderr."""
    path = tmp_path / "scenario.json"
    path.write_bytes(data)
    code = cli.main(["plan", str(path)])
    return code, capsys.readouterr().err


def edited(path: str, value: Any = None, *, delete: bool = False) -> bytes:
    """Return BASE as JSON with the value at `path` (keys and list indices joined by `/`)
    replaced or deleted."""
    document = copy.deepcopy(BASE)
    *parents, last = path.split("/")

    def key(node: Any, part: str) -> Any:
        return int(part) if isinstance(node, list) else part

    node: Any = document
    for part in parents:
        node = node[key(node, part)]
    if delete:
        del node[key(node, last)]
    else:
        node[key(node, last)] = value
    return json.dumps(document).encode()


def refused_in_one_line(code: int, err: str) -> bool:
    return code == cli.EXIT_INPUT and err.startswith("kvferry: error: ") and err.count("\n") == 1


def test_the_base_scenario_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan(tmp_path, capsys, json.dumps(BASE).encode()) == (0, "")


MALFORMED = [
    ("missing config", edited("config", delete=True), "'config'"),
    ("missing request", edited("request", delete=True), "'request'"),
    ("missing steps", edited("steps", delete=True), "'steps'"),
    ("missing num_tokens", edited("request/num_tokens", delete=True), "'request.num_tokens'"),
    ("missing step op", edited("steps/0/op", delete=True), "'steps[0].op'"),
    ("config as a list", edited("config", []), "'config'"),
    ("num_tokens as a string", edited("request/num_tokens", "85"), "'request.num_tokens'"),
    ("num_tokens as null", edited("request/num_tokens", None), "'request.num_tokens'"),
    ("num_tokens as a float", edited("request/num_tokens", 85.5), "'request.num_tokens'"),
    ("NaN for a count", edited("steps/0/num_computed_tokens", float("nan")), "NaN"),
    (
        "a count as a bool",
        edited("steps/0/num_computed_tokens", True),
        "'steps[0].num_computed_tokens'",
    ),
    (
        "negative computed",
        edited("steps/0/num_computed_tokens", -16),
        "'steps[0].num_computed_tokens'",
    ),
    ("negative free rows", edited("tier/free_rows", -1), "'tier.free_rows'"),
    ("negative prompt", edited("request/num_prompt_tokens", -1), "'request.num_prompt_tokens'"),
    ("hit as a float", edited("steps/1/hit_tokens", 16.0), "'steps[1].hit_tokens'"),
    ("store_loaded as a string", edited("request/store_loaded", "false"), "'request.store_loaded'"),
    (
        "decoded flag as a string",
        edited("config/store_decoded_tokens", "false"),
        "'config.store_decoded_tokens'",
    ),
    ("F as a string", edited("config/blocks_per_chunk", "1"), "'config.blocks_per_chunk'"),
    ("F of 0", edited("config/blocks_per_chunk", 0), "'config.blocks_per_chunk'"),
    ("request id as a number", edited("request/request_id", 7), "'request.request_id'"),
    ("non-hex hashes", edited("request/block_hashes", ["zz"] * 21), "'request.block_hashes[0]'"),
    (
        "odd-length hashes",
        edited("request/block_hashes", ["abc"] * 21),
        "'request.block_hashes[0]'",
    ),
    ("a hash as a number", edited("request/block_hashes", [12] * 21), "'request.block_hashes[0]'"),
    ("unknown group kind", edited("config/groups/1/kind", "window"), "'config.groups[1].kind'"),
    ("a group as a number", edited("config/groups/1", 3), "'config.groups[1]'"),
    ("no groups", edited("config/groups", []), "'config.groups'"),
    ("a tier group that is not a number", edited("tier/ready", {"x": [0]}), "'tier.ready.x'"),
    ("a tier group out of range", edited("tier/ready", {"3": [0]}), "'tier.ready.3'"),
    ("a tier chunk as a string", edited("tier/ready", {"0": ["0"]}), "'tier.ready.0[0]'"),
    (
        "a cached block in other digits",
        edited("steps/1/blocks/0/0", "c\u00b2"),
        "'steps[1].blocks[0][0]'",
    ),
    ("a negative block", edited("steps/1/blocks/0/4", -15), "'steps[1].blocks[0][4]'"),
    ("one block list short", edited("steps/1/blocks", [[1]]), "'steps[1].blocks'"),
    ("an unknown op", edited("steps/0/op", "evict"), "'steps[0].op'"),
    (
        "a misspelled step field",
        edited("steps/0/num_computed_token", 48),
        "did you mean 'num_computed_tokens'",
    ),
    ("an unknown top-level field", edited("tiers", {}), "did you mean 'tier'"),
    ("a field of another op", edited("steps/0/hit_tokens", 16), "'steps[0].hit_tokens'"),
    ("schema version as a bool", edited("schema_version", True), "'schema_version'"),
    ("schema version 2", edited("schema_version", 2), "'schema_version'"),
    ("a top-level list", b"[1, 2]", "'scenario'"),
    ("an empty file", b"", "'scenario'"),
    ("not UTF-8", b'{"schema_version": 1, "description": "\xff\xfe"}', "UTF-8"),
    ("not JSON", b"{schema_version: 1}", "JSON text"),
    ("deep nesting", b'{"description": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nest"),
    ("a 5000-digit number", b'{"schema_version": ' + b"1" * 5000 + b"}", "5000 characters"),
    ("a key twice", b'{"schema_version": 1, "schema_version": 1}', "once"),
    ("Infinity", b'{"schema_version": Infinity}', "Infinity"),
]


@pytest.mark.parametrize(("name", "data", "named"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_scenario_is_refused_in_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, data: bytes, named: str
) -> None:
    code, err = plan(tmp_path, capsys, data)
    assert refused_in_one_line(code, err), err
    assert named in err, err


def test_a_billion_tokens_are_refused_before_keys_are_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.perf_counter()
    code, err = plan(tmp_path, capsys, edited("request/num_tokens", 10**9))
    assert refused_in_one_line(code, err), err
    assert "'request.num_tokens'" in err and "hash blocks" in err
    assert time.perf_counter() - started < 5


def test_a_huge_file_is_refused_without_reading_it_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = plan(tmp_path, capsys, b" " * (MAX_SCENARIO_BYTES + 1) + json.dumps(BASE).encode())
    assert refused_in_one_line(code, err), err
    assert f"at most {MAX_SCENARIO_BYTES} bytes" in err


def test_an_endless_file_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    code = cli.main(["plan", "/dev/zero"])
    assert refused_in_one_line(code, capsys.readouterr().err)
    assert time.perf_counter() - started < 10


def test_a_missing_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["plan", str(tmp_path / "nowhere.json")])
    assert refused_in_one_line(code, capsys.readouterr().err)


def _paths(node: Any, path: tuple[str, ...] = ()) -> list[str]:
    found: list[str] = []
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        here = (*path, str(key))
        found.append("/".join(here))
        found += _paths(child, here)
    return found


WRONG_VALUES: list[Any] = [None, True, "7", -1, 1.5, 10**30, [], {}, [1, "x"], {"0": None}, "zz"]


def test_every_mutation_of_a_scenario_plans_or_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outcomes = {"planned": 0, "refused": 0}
    for path in _paths(BASE):
        for data in [edited(path, delete=True), *(edited(path, v) for v in WRONG_VALUES)]:
            code, err = plan(tmp_path, capsys, data)
            if code == 0:
                outcomes["planned"] += 1
            else:
                assert refused_in_one_line(code, err), (path, data, err)
                outcomes["refused"] += 1
    assert outcomes["refused"] > outcomes["planned"], outcomes
