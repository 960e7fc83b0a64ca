"""One settings loader for both services: a frozen dataclass built once from the environment and flags.

A service declares its settings as dataclass fields. A field made with `env_field("KEV_X", default)`
is read from the environment variable KEV_X (unset or empty: the default; no default: required);
every field, unless declared `flag=False`, also gets a flag named after it (`max_rows_per_pass` ->
`--max-rows-per-pass`) that overrides the environment. Fields without `env_field` are flags only.
Values are converted by the field's annotation (int, float, Path, else str; `X | None` as X).

    @dataclass(frozen=True)
    class MyConfig:
        checkpoint: Path = env_field("KEV_CHECKPOINT")             # required
        listen: str = env_field("KEV_LISTEN", "0.0.0.0:50051")
        grpc_workers: int = 64                                     # --grpc-workers only

    config = load_settings(MyConfig, os.environ, sys.argv[1:], prog="python -m my_service")

Validation stays with each service (`__post_init__` raising `ConfigError`, which names the variable
or flag); `redacted(config)` is the dict logged at start-up with URL passwords masked, and
`graph_plan(...)` the CUDA-graph plan both services derive from their graph settings.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, asdict, field, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from kev.exec.plan import GraphPlan, parse_warm_classes

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is missing or malformed (the message names the variable or flag)."""


def env_field(name: str, default: Any = MISSING, *, flag: bool = True, choices: Sequence[str] | None = None):
    """A setting read from the environment variable `name` (and from its flag unless `flag=False`)."""
    return field(default=default, metadata={"env": name, "flag": flag, "choices": choices})


def flag_field(default: Any, *, choices: Sequence[str] | None = None):
    """A flag-only setting whose flag takes only `choices`."""
    return field(default=default, metadata={"choices": choices})


def env_name(f: Field) -> str | None:
    return f.metadata.get("env")


def flag_name(f: Field) -> str:
    return "--" + f.name.replace("_", "-")


def setting_name(f: Field) -> str:
    """How messages name a setting: its variable, else its flag."""
    return env_name(f) or flag_name(f)


def load_settings(cls: type[T], environ: Mapping[str, str], argv: Sequence[str] | None, *, prog: str,
                  description: str = "", defaults: Mapping[str, Any] | None = None) -> T:
    """Build `cls` from `environ` and the flags in `argv` (a flag overrides its variable).

    `defaults` replaces field defaults computed at run time (e.g. the host name); `argv=None` reads
    sys.argv. A missing required setting or a malformed number raises ConfigError; a bad flag exits
    as argparse does (status 2)."""
    defaults = dict(defaults or {})
    parser = argparse.ArgumentParser(prog=prog, description=description)
    for f in fields(cls):
        if not f.metadata.get("flag", True):
            continue
        env = env_name(f)
        default = defaults.get(f.name, "-" if f.default is MISSING else f.default)
        parser.add_argument(flag_name(f), dest=f.name, default=None, choices=f.metadata.get("choices"),
                            help=f"{'env ' + env + '; ' if env else ''}default {default}")
    args = vars(parser.parse_args(argv))
    values = {}
    for f in fields(cls):
        raw = args.get(f.name)
        if raw is None or raw == "":
            env = env_name(f)
            raw = environ.get(env) if env else None
        if raw is None or raw == "":
            if f.name in defaults:
                values[f.name] = defaults[f.name]
            elif f.default is MISSING:
                raise ConfigError(f"{setting_name(f)} is required")
            continue
        values[f.name] = _convert(setting_name(f), f.type, raw)
    return cls(**values)


def _convert(name: str, kind: object, raw: str) -> object:
    kind = str(kind).replace(" | None", "").replace("None | ", "")  # annotations are strings (PEP 563)
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if kind == "bool":
        value = raw.strip().lower()
        if value not in _BOOLS:
            raise ConfigError(f"{name} must be one of {', '.join(_BOOLS)}, got {raw!r}")
        return _BOOLS[value]
    if kind == "Path":
        return Path(raw)
    return raw


_BOOLS = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by ***."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redacted(config: Any, **extra: Any) -> dict:
    """Every field for the start-up log (paths as strings, URL passwords masked), plus `extra`."""
    out = {}
    for k, v in asdict(config).items():
        if isinstance(v, Path):
            v = str(v)
        elif isinstance(v, str) and "://" in v:
            v = redact_url(v)
        out[k] = v
    out.update(extra)
    return out


def log_settings(log: logging.Logger, config: Any) -> None:
    """The start-up log line of a service's settings: `config.redacted()` as JSON."""
    log.info("config %s", json.dumps(config.redacted(), sort_keys=True, default=str))


def check_server_security(config: Any) -> None:
    """The checks both services make of their own server's TLS, token and reflection settings
    (fields `tls_cert`, `tls_key`, `tls_client_ca`, `auth_token_file`, `reflection`)."""
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("KEV_TLS_CERT and KEV_TLS_KEY go together")
    if (config.tls_client_ca or config.auth_token_file) and not config.tls_cert:
        raise ConfigError("KEV_TLS_CLIENT_CA and KEV_AUTH_TOKEN_FILE need TLS (KEV_TLS_CERT, KEV_TLS_KEY)")
    if config.reflection not in ("on", "off"):
        raise ConfigError(f"KEV_REFLECTION must be on or off, got {config.reflection!r}")


def graph_plan(*, cuda_graphs: bool, warm_classes: str, **caps: int) -> GraphPlan:
    """What a service captures on CUDA (kev/exec/plan.py): KEV_CUDA_GRAPHS (every key up to the
    service's pass caps, `caps`: GraphPlan's row_* / state_* fields) and KEV_WARM_CLASSES. Raises
    ConfigError naming the variable; services call it from `__post_init__` so bad settings fail at
    start-up."""
    warm = _parse("KEV_WARM_CLASSES", parse_warm_classes, warm_classes)
    return GraphPlan(cuda_graphs=cuda_graphs, warm=warm, **caps)


def _parse(name: str, parse: Callable[[str], Any], text: str) -> Any:
    try:
        return parse(text)
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
