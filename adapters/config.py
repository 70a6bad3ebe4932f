"""kvferry's configuration: one frozen value from a dict, a TOML file or `KVFERRY_*` variables.

Reads files and the environment only when asked (`from_toml`, `from_env`; `catalog_config`
reads the host's memory size to refuse a tier no host could hold); validating a value
names the key and the allowed values, and nothing here builds an executor or allocates memory.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvferry.adapters.workers import DEFAULT_REPLY_TIMEOUT
from kvferry.core.catalog import CatalogConfig, rows_for_budget
from kvferry.core.errors import InvalidInputError, UnknownExecutorError, did_you_mean
from kvferry.core.eviction import EvictionPolicyKind
from kvferry.executors.host import host_memory_bytes
from kvferry.executors.registry import executor_class, executor_entries

ENV_PREFIX = "KVFERRY_"
"""Environment variables `KVFERRY_<KEY>` set the key `<key>` (upper-cased)."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
MAX_NUMBER = (1 << 63) - 1
"""Largest count or byte count a setting takes (what a signed 64-bit integer holds)."""
_SIZE = re.compile(r"\s*([0-9]{1,19})\s*([a-zA-Z]*)\s*", re.ASCII)
_COUNT = re.compile(r"\s*([0-9]{1,19})\s*", re.ASCII)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bad(key: str, expected: str, got: object) -> InvalidInputError:
    return InvalidInputError(field=key, expected=expected, got=got)


def parse_bytes(key: str, value: object) -> int:
    """Return a byte count from an integer or a string such as "512MiB" or "8 GB" (ASCII
    digits, at most MAX_NUMBER bytes)."""
    expected = (
        f"a byte count >= 1 (at most {MAX_NUMBER}): an integer or a string such as '512MiB', '8GB'"
    )
    if isinstance(value, bool):
        raise _bad(key, expected, value)
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise _bad(key, expected + " (units: " + ", ".join(u for u in _UNITS if u) + ")", value)
        number = int(match.group(1)) * _UNITS[unit]
    else:
        raise _bad(key, expected, value)
    if not 1 <= number <= MAX_NUMBER:
        raise _bad(key, expected, value)
    return number


def _parse_executor(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise _bad(key, "an executor name (a string)", value)
    known = executor_entries()
    if value not in known:
        try:
            executor_class(value)  # raises with the registry's "did you mean"
        except UnknownExecutorError as error:
            raise _bad(key, f"one of {', '.join(sorted(known))} ({error})", value) from None
    return value


def _parse_policy(key: str, value: object) -> EvictionPolicyKind:
    if isinstance(value, EvictionPolicyKind):
        return value
    try:
        return EvictionPolicyKind.from_name(str(value))
    except InvalidInputError as error:
        raise _bad(key, error.expected, value) from None


def _parse_positive(key: str, value: object) -> int:
    number = value
    if isinstance(value, str):  # ASCII digits only: "²".isdigit() is True, int("²") fails
        match = _COUNT.fullmatch(value)
        number = int(match.group(1)) if match else None
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= MAX_NUMBER:
        raise _bad(key, f"an integer >= 1 (at most {MAX_NUMBER})", value)
    return number


MAX_SECONDS = 86400.0
"""Longest timeout a setting takes (a day)."""
_SECONDS = re.compile(r"\s*([0-9]{1,9}(?:\.[0-9]{1,9})?)\s*", re.ASCII)


def _parse_seconds(key: str, value: object) -> float:
    number = value
    if isinstance(value, str):
        match = _SECONDS.fullmatch(value)
        number = float(match.group(1)) if match else None
    if (
        isinstance(number, bool)
        or not isinstance(number, (int, float))
        or not 0 < number <= MAX_SECONDS
    ):
        raise _bad(key, f"seconds > 0 (at most {MAX_SECONDS:g}), e.g. 30 or 2.5", value)
    return float(number)


def _parse_bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _bad(key, "true or false (env: 1/0, true/false, yes/no, on/off)", value)


def _parse_weights(key: str, value: object) -> tuple[int, ...]:
    """Return per-group weights from a sequence of integers or a string such as "1,4"."""
    items: object = value
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")]
    if not isinstance(items, (list, tuple)) or not items:
        raise _bad(key, "integers >= 1, one per KV-cache group, e.g. [1, 4] or '1,4'", value)
    try:
        return tuple(_parse_positive(key, item) for item in items)
    except InvalidInputError:
        raise _bad(
            key, "integers >= 1, one per KV-cache group, e.g. [1, 4] or '1,4'", value
        ) from None


def _optional(parse: Callable[[str, object], Any]) -> Callable[[str, object], Any]:
    def parse_or_none(key: str, value: object) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none"}):
            return None
        return parse(key, value)

    return parse_or_none


@attrs.frozen(kw_only=True)
class ConfigKey:
    """One configuration key: how it is read, what it defaults to, what it allows."""

    name: str
    """The key in dicts and TOML files."""
    kind: str
    """Its type, as docs/configuration.md writes it."""
    default: object
    """The value when no source sets it."""
    allowed: str
    """The values it accepts, in words."""
    parse: Callable[[str, object], Any] = attrs.field(eq=False, repr=False)
    """Turns a raw value (from a dict, TOML or an environment string) into the typed one."""
    help: str
    """What it selects."""
    gpu_only: bool = False
    """Only GPU executors use it: set for a host executor, it is refused (never ignored)."""

    @property
    def env(self) -> str:
        """Return the environment variable that sets it."""
        return ENV_PREFIX + self.name.upper()


CONFIG_KEYS: dict[str, ConfigKey] = {
    key.name: key
    for key in (
        ConfigKey(
            name="executor",
            kind="string",
            default="cpu",
            allowed="a registered executor: cpu, torch, cupy (or one added by entry point)",
            parse=_parse_executor,
            help="which executor copies the bytes",
        ),
        ConfigKey(
            name="cpu_tier_bytes",
            kind="integer or size string",
            default=None,
            allowed="bytes >= 1, e.g. 68719476736, '64GiB', '512MB'; unset: the demo profile's",
            parse=_optional(parse_bytes),
            help="pinned host memory for the CPU tier (whole rows of it are used)",
        ),
        ConfigKey(
            name="cpu_tier_group_weights",
            kind="list of integers",
            default=None,
            allowed="integers >= 1, one per KV-cache group, e.g. [1, 4] or '1,4'; unset: 1 each",
            parse=_optional(_parse_weights),
            help="chunks of the CPU tier per group, relative (unset: every group holds as many)",
        ),
        ConfigKey(
            name="eviction_policy",
            kind="string",
            default=EvictionPolicyKind.LRU,
            allowed=", ".join(kind.value for kind in EvictionPolicyKind),
            parse=_parse_policy,
            help="which ready chunks the CPU tier evicts first",
        ),
        ConfigKey(
            name="blocks_per_chunk",
            kind="integer",
            default=None,
            allowed="an integer >= 1; unset: the demo profile's",
            parse=_optional(_parse_positive),
            help="GPU blocks per offloaded chunk (F), the same for every group",
        ),
        ConfigKey(
            name="store_decoded_tokens",
            kind="boolean",
            default=True,
            allowed="true or false",
            parse=_parse_bool,
            help="store chunks of generated tokens too (false: the prompt's only)",
        ),
        ConfigKey(
            name="staging_bytes",
            kind="integer or size string",
            default=None,
            allowed="bytes >= 1; unset: the executor's default (GPU executors only)",
            parse=_optional(parse_bytes),
            help="staging buffer per direction of the torch and cupy executors",
            gpu_only=True,
        ),
        ConfigKey(
            name="submit_thread",
            kind="boolean",
            default=True,
            allowed="true or false (GPU executors only)",
            parse=_parse_bool,
            help="make staged jobs' CUDA calls on a thread of the executor's own",
            gpu_only=True,
        ),
        ConfigKey(
            name="worker_reply_timeout",
            kind="number",
            default=DEFAULT_REPLY_TIMEOUT,
            allowed=f"seconds > 0, at most {MAX_SECONDS:g}; e.g. 30 or 2.5",
            parse=_parse_seconds,
            help="how long a tensor-parallel worker may take to answer before it counts as hung",
        ),
        ConfigKey(
            name="no_native",
            kind="boolean",
            default=False,
            allowed="true or false",
            parse=_parse_bool,
            help="per-job host work in Python even where the compiled module is built",
        ),
        ConfigKey(
            name="record_events",
            kind="boolean",
            default=False,
            allowed="true or false",
            parse=_parse_bool,
            help="keep the catalog's stored/removed events for a router to drain",
        ),
    )
}
"""Every key: drives parsing, the errors, the tests and docs/configuration.md."""


@attrs.frozen(kw_only=True)
class KvferryConfig:
    """What a deployment of kvferry chooses; build it with `from_mapping`, `from_toml`,
    `from_env` or `load`, which validate every value."""

    executor: str = "cpu"
    """Executor name (see `kvferry.executors.registry`)."""
    cpu_tier_bytes: int | None = None
    """CPU-tier budget in bytes; None: the caller's default (the demo's profile)."""
    cpu_tier_group_weights: tuple[int, ...] | None = None
    """Chunks of the tier per group, relative (`rows_for_budget`'s weights); None: equal."""
    eviction_policy: EvictionPolicyKind = EvictionPolicyKind.LRU
    """The catalog's eviction policy."""
    blocks_per_chunk: int | None = None
    """`F`; None: the caller's default (the demo's profile)."""
    store_decoded_tokens: bool = True
    """Store generated tokens' chunks too."""
    staging_bytes: int | None = None
    """Staging bytes per direction for GPU executors; None: the executor's default."""
    submit_thread: bool = True
    """GPU executors make staged jobs' driver calls on a thread of their own."""
    no_native: bool = False
    """Executors take the Python route (`kvferry.executors.jobcode`), not the compiled one."""
    record_events: bool = False
    """Keep catalog events for `drain_events`."""
    worker_reply_timeout: float = DEFAULT_REPLY_TIMEOUT
    """Seconds a tensor-parallel worker may take to answer one command (a stopped or hung
    worker is named once they pass)."""

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, object], *, base: KvferryConfig | None = None
    ) -> KvferryConfig:
        """Return `base` (default: the defaults) with the keys of `values` set, each validated.

        Raises InvalidInputError naming the key for an unknown key (with "did you mean") or a
        bad value (with the allowed values).
        """
        if not isinstance(values, Mapping):
            raise _bad("config", "a table of keys", values)
        changes: dict[str, Any] = {}
        for key, raw in values.items():
            spec = CONFIG_KEYS.get(key)
            if spec is None:
                hint = did_you_mean(key, CONFIG_KEYS)
                raise _bad(str(key), "one of the keys " + ", ".join(CONFIG_KEYS) + hint, raw)
            changes[key] = spec.parse(key, raw)
        return attrs.evolve(base or cls(), **changes)

    @classmethod
    def from_toml(cls, path: str | Path, *, base: KvferryConfig | None = None) -> KvferryConfig:
        """Return the configuration a TOML file sets (top-level keys) over `base`."""
        loads = _toml_loads()
        text = Path(path).read_text(encoding="utf-8")
        try:
            values = loads(text)
        except ValueError as error:  # tomllib.TOMLDecodeError is a ValueError
            raise _bad("config file", f"valid TOML ({error})", str(path)) from None
        return cls.from_mapping(values, base=base)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, base: KvferryConfig | None = None
    ) -> KvferryConfig:
        """Return the configuration the `KVFERRY_*` variables of `environ` (default: the
        process environment) set over `base`; an unknown `KVFERRY_*` variable is an error."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for name, raw in environ.items():
            if not name.startswith(ENV_PREFIX):
                continue
            key = name[len(ENV_PREFIX) :].lower()
            if key not in CONFIG_KEYS:
                names = [spec.env for spec in CONFIG_KEYS.values()]
                hint = did_you_mean(name, names)
                raise _bad(name, "one of the variables " + ", ".join(names) + hint, raw)
            values[key] = raw
        try:
            return cls.from_mapping(values, base=base)
        except InvalidInputError as error:
            spec = CONFIG_KEYS.get(error.field)
            field = f"{spec.env} ({spec.name})" if spec else error.field
            raise _bad(field, error.expected, error.got) from None

    @classmethod
    def load(
        cls, path: str | Path | None = None, environ: Mapping[str, str] | None = None
    ) -> KvferryConfig:
        """Return the defaults, overridden by the TOML file at `path` (when given), overridden
        by the `KVFERRY_*` environment variables."""
        config = cls() if path is None else cls.from_toml(path)
        return cls.from_env(environ, base=config)

    def catalog_config(
        self, row_pitches: int | Sequence[int], *, default_tier_bytes: int | None = None
    ) -> CatalogConfig:
        """Return the catalog configuration for the groups' rows of `row_pitches` bytes (the
        executor layout's `row_pitches`, times the workers that each pin a tier): the budget
        split by `rows_for_budget`, every group holding the same number of chunks, or chunks in
        the ratio of `cpu_tier_group_weights`. Raise InvalidInputError when the weights are not
        one per group, the budget holds no row of some group, or more than the host's memory
        (checked before any executor allocates its tier)."""
        budget = self.cpu_tier_bytes if self.cpu_tier_bytes is not None else default_tier_bytes
        if budget is None:
            raise _bad("cpu_tier_bytes", "a byte budget (no default here)", None)
        pitches = (row_pitches,) if isinstance(row_pitches, int) else tuple(row_pitches)
        weights = self.cpu_tier_group_weights
        if weights is not None and len(weights) != len(pitches):
            raise _bad(
                "cpu_tier_group_weights", f"one weight per KV-cache group ({len(pitches)})", weights
            )
        rows = rows_for_budget(budget, pitches, weights=weights)
        if min(rows) < 1:
            raise _bad(
                "cpu_tier_bytes", f"at least one row of each group ({sum(pitches)} bytes)", budget
            )
        used = sum(r * p for r, p in zip(rows, pitches, strict=True))
        if used > (memory := host_memory_bytes()):
            raise _bad("cpu_tier_bytes", f"at most the host's memory ({memory} bytes)", budget)
        return CatalogConfig(
            capacity_rows=rows, policy=self.eviction_policy, record_events=self.record_events
        )

    def executor_options(self, *, on_gpu: bool = True) -> dict[str, Any]:
        """Return the backend keyword arguments for `make_executor` that this config sets.

        With `on_gpu` False (the chosen executor copies host memory), raise InvalidInputError
        naming a GPU-only key that is set: the executor would not use it.
        """
        if not on_gpu:
            for spec in CONFIG_KEYS.values():
                value = getattr(self, spec.name)
                if spec.gpu_only and value != spec.default:
                    raise _bad(
                        spec.name,
                        f"no value with the {self.executor!r} executor (the key applies to GPU "
                        "executors only: unset it, or choose torch or cupy)",
                        value,
                    )
        options: dict[str, Any] = {}
        if self.staging_bytes is not None:
            options["staging_bytes"] = self.staging_bytes
        if not self.submit_thread:
            options["submit_thread"] = False
        if self.no_native:
            options["route"] = "python"
        return options


def _toml_loads() -> Callable[[str], dict[str, Any]]:
    """Return a TOML parser: `tomllib` (Python 3.11+) or, on 3.10, `tomli` if installed."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads
    try:
        tomli: Any = importlib.import_module("tomli")
    except ImportError:
        raise _bad(
            "config file",
            "Python 3.11+ (tomllib), or the tomli package on Python 3.10 (pip install tomli)",
            "Python " + ".".join(str(part) for part in sys.version_info[:2]) + " without tomli",
        ) from None
    loads: Callable[[str], dict[str, Any]] = tomli.loads
    return loads
