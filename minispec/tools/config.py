"""Settings of a tool: a dataclass filled from its defaults, a TOML file, then overrides."""
from __future__ import annotations

import inspect
import re
import tomllib
from dataclasses import fields


def read_toml(path: str, known: set[str]) -> dict:
    """A TOML settings file as a dict; ValueError naming any key outside `known`."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    _check_keys(raw, known, path)
    return raw


def _check_keys(raw: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def load_settings(cls, path: str | None = None, overrides: dict | None = None):
    """cls's defaults < the TOML file at path < overrides (None values skipped), then cfg.validate() if cls has it.

    Unknown keys, in the file or the overrides, are a ValueError naming them.
    """
    known = {f.name for f in fields(cls)}
    raw = read_toml(path, known) if path is not None else {}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    _check_keys(given, known, "overrides")
    cfg = cls(**{**raw, **given})
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def field_help(cls) -> dict[str, str]:
    """Each dataclass field's trailing comment (`name: type = default  # comment`), the --help text of its flag."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^=]+=.*?  # (.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).replace("%", "%%")
    return out
