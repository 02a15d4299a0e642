"""Options from a file and from ``--set``: ``meshkit train --config run.toml`` (top-level keys and
``[section]`` tables, or a run's ``config.json``) and ``--set section.key=value``, each key and value
checked with the command line's rules, every error named in one line."""

from __future__ import annotations

import json
from typing import Any

from meshkit.train.config import OPTIONS, PRESETS, SECTION_OF, ConfigError, check_type

#: The tables of a config file: the config's sections (``TrainConfig``), each holding its options by their one
#: name (an option may also be given at the top level).
SECTIONS: dict[str, tuple[str, ...]] = {
    section: tuple(n for n, s in SECTION_OF.items() if s == section)
    for section in dict.fromkeys(SECTION_OF.values())
}


def _suggest(key: str, known: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def user_value(name: str, value: Any) -> Any:
    """A value as the command line gives it: ``clip`` 0 turns clipping off (None)."""
    return None if name == "clip" and value == 0 and not isinstance(value, bool) else value


def _option(key: str, value: Any, where: str, errors: list[str], out: dict[str, Any]) -> None:
    """Check one ``key`` (``name`` or ``section.name``) and put it in ``out``, or an error in ``errors``."""
    section, _, name = key.rpartition(".")
    if name == "preset" and not section:
        if value not in PRESETS:
            errors.append(f"{where}: preset must be {' or '.join(PRESETS)}, got {value!r}")
        out["preset"] = value
        return
    if name not in SECTION_OF:
        known = [*(f"{s}.{n}" for s, ns in SECTIONS.items() for n in ns), *OPTIONS, "preset"]
        errors.append(f"{where}: unknown option '{key}'{_suggest(key, known)}")
        return
    if section and section != SECTION_OF[name]:
        errors.append(f"{where}: '{name}' belongs in [{SECTION_OF[name]}], not [{section}]")
        return
    try:
        check_type(name, value, where)
    except ConfigError as e:
        errors.append(str(e))
        return
    out[name] = user_value(name, value)


def _flatten(data: dict[str, Any], where: str, errors: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, item in value.items():
                _option(f"{key}.{name}", item, where, errors, out)
        elif key in SECTIONS and key not in OPTIONS:
            errors.append(f"{where}: '{key}' is a table of options: write [{key}] with keys under it")
        else:
            _option(key, value, where, errors, out)
    return out


def _raise(errors: list[str]) -> None:
    if errors:
        raise ConfigError("; ".join(errors))


def written_options(config: str | None, sets: list[str]) -> dict[str, Any]:
    """The options of ``--config`` overlaid by ``--set``'s; every unknown key and wrong type of both is
    named, all in one line."""
    errors: list[str] = []
    out = read_config_file(config, errors) if config else {}
    out |= parse_sets(sets, errors)
    _raise(errors)
    return out


def read_config_file(path: str, errors: list[str]) -> dict[str, Any]:
    """Options from a TOML file (or a run's ``config.json``): top-level keys and ``[section]`` tables
    (:data:`SECTIONS`), and ``preset``. A key or value that is wrong goes into ``errors``; a file that
    cannot be read raises."""
    import tomllib
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        what = "a directory" if file.is_dir() else "missing"
        raise ConfigError(f"--config '{path}' is {what}: give a TOML file of options (e.g. run.toml)")
    try:
        text = file.read_text(encoding="utf-8")
        data = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        kind = "JSON" if file.suffix == ".json" else "TOML"
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"--config '{path}' is not valid {kind} ({first}): fix the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config '{path}' is not a table of options: give a TOML file of options")
    return _flatten(data, str(path), errors)


def parse_sets(items: list[str], errors: list[str]) -> dict[str, Any]:
    """``--set section.key=value`` (or ``key=value``) options: the value read as TOML (``1e-3``, ``true``,
    ``"text"``), or as text where it is not TOML (``--set plan=fsdp``)."""
    import tomllib

    out: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            errors.append(f"--set {item!r} is not key=value: write e.g. --set optimizer.lr=1e-3")
            continue
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        _option(key.strip(), value, "--set", errors, out)
    return out
