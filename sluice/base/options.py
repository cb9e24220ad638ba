"""`sluice serve`'s flags, `--config` files and docs/flags.md's flag table, all derived from ServerConfig's
fields (sluice/config.py), where each option is defined once."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import inspect as mi

from sluice.base.config import ServerConfig, parse_size


@dataclass(frozen=True)
class Flag:
    field: str  # the ServerConfig field it sets
    flag: str  # as typed: --max-num-seqs, --no-prefix-caching
    kind: str  # "value" | "list" | "on" (a bool flag that sets True) | "off" (one that sets False)
    convert: Any  # str -> the field's value
    choices: tuple[str, ...] | None
    unit: str | None
    help: str
    default: Any
    default_text: str | None

    @property
    def config_key(self) -> str:
        """The flag's own name as a --config key (besides the field's name)."""
        return self.flag[2:].replace("-", "_")

    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.kind in ("on", "off"):
            return "not set"
        if self.default is None:
            return "none"
        if self.unit == "bytes":
            return _bytes_text(self.default)
        return f"{self.default:g} {self.unit}" if self.unit else str(self.default)


def _bytes_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _base(t: mi.Type) -> mi.Type:
    return t.type if isinstance(t, mi.Metadata) else t


def flags() -> list[Flag]:
    out = []
    info = mi.type_info(ServerConfig)
    assert isinstance(info, mi.StructType)
    for f in info.fields:
        meta = f.type if isinstance(f.type, mi.Metadata) else None
        extra = (meta.extra or {}) if meta else {}
        if extra.get("derived"):
            continue
        t = _base(f.type)
        if isinstance(t, mi.UnionType):  # X | None
            t = next(_base(x) for x in t.types if not isinstance(x, mi.NoneType))
        choices = tuple(str(v) for v in t.values) if isinstance(t, mi.LiteralType) else None
        convert: Any
        if isinstance(t, mi.BoolType):
            kind, convert = ("off" if f.default else "on"), bool
        elif isinstance(t, mi.ListType):
            kind, convert = "list", str
        else:
            kind = "value"
            convert = parse_size if extra.get("unit") == "bytes" else {mi.IntType: int, mi.FloatType: float}.get(
                type(t), str)
        out.append(Flag(f.name, extra.get("flag") or "--" + f.name.replace("_", "-"), kind, convert, choices,
                        extra.get("unit"), (meta.extra_json_schema or {}).get("description", "") if meta else "",
                        f.default, extra.get("default_text")))
    return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every option as a flag. Only flags given on the command line land in the namespace (a config file's
    values, then the defaults, fill the rest)."""
    for f in flags():
        help_text = f"{f.help} (default: {f.shown_default()})".replace("%", "%%")
        common: dict[str, Any] = dict(dest=f.field, default=argparse.SUPPRESS, help=help_text)
        if f.kind in ("on", "off"):
            parser.add_argument(f.flag, action="store_const", const=f.kind == "on", **common)
        elif f.kind == "list":
            parser.add_argument(f.flag, nargs="+", action="extend", metavar=f.field.upper().rstrip("S"), **common)
        else:
            parser.add_argument(f.flag, type=f.convert, choices=f.choices, metavar=_metavar(f), **common)


def _metavar(f: Flag) -> str | None:
    if f.choices:
        return "{" + ",".join(f.choices) + "}"
    return {"bytes": "SIZE", "s": "SECONDS", "ms": "MS"}.get(f.unit or "", None)


def config_file_values(data: dict, source: str) -> dict:
    """A --config file's mapping (keys: field names or flag names, dashes or underscores) as field values."""
    by_key: dict[str, Flag] = {}
    for flag in flags():
        by_key[flag.field] = by_key[flag.config_key] = flag
    out: dict[str, Any] = {}
    unknown: list[Any] = []
    for key, value in data.items():
        f = by_key.get(str(key).replace("-", "_"))
        if f is None:
            unknown.append(key)
            continue
        if f.kind == "off" and key not in (f.field, f.field.replace("_", "-")) and isinstance(value, bool):
            value = not value  # `no-prefix-caching: true`
        elif f.unit == "bytes" and isinstance(value, str):
            value = parse_size(value)
        elif f.kind == "list" and isinstance(value, str):
            value = [value]
        out[f.field] = value
    if unknown:
        raise ValueError(f"{source}: unknown settings {sorted(map(str, unknown))}")
    return out


def validated(values: dict) -> ServerConfig:
    """ServerConfig from field values, every bound checked; the error names the flag."""
    try:
        return msgspec.convert(values, ServerConfig)
    except msgspec.ValidationError as e:
        text = str(e)
        for f in flags():
            if text.endswith(f"at `$.{f.field}`"):
                raise ValueError(f"{f.flag}: {text.rsplit(' - at ', 1)[0].lower()}") from None
        raise ValueError(text) from None


def flag_table() -> str:
    """docs/flags.md's flag table (tests/test_cli.py keeps docs/flags.md equal to it)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in flags():
        default = f.shown_default()
        default = f"`{default}`" if f.default_text is None and f.kind not in ("on", "off") else default
        rows.append(f"| `{f.flag}` | {default} | {f.help} |")
    return "\n".join(rows) + "\n"
