"""The loader: Pulumi config or a stack file in, a validated `StackConfig` out, or one line per problem.

Reads the flat Pulumi config (`namespace:key` -> string) the CLI hands the
program, or a `Pulumi.<stack>.yaml` offline; checks the namespaces and the
API keys secret; turns pydantic's validation errors into `Problem`s named by
key path; then runs the cross-field rules (rules.py).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi
import yaml
from pydantic import ValidationError

from infra.config.problems import ConfigError, Problem
from infra.config.rules import check_rules
from infra.config.stack import StackConfig
from workloads.inference_server.api_keys import BATCH_WORKER_KEY_ID, FINGERPRINT_PREFIX, KeyFormatError, parse_entry

NAMESPACE = "llm-platform"
SECRET_API_KEYS = "api_keys"
API_KEY_MIN_LENGTH = 24
# A stand-in for the API keys secret when a stack file does not carry it
# (each user sets it with `pulumi config set --secret`); never a real key.
PLACEHOLDER_API_KEYS = "render-placeholder-key-0000000000000000"
# The config namespaces a stack may use, and what reads each. A key in any
# other namespace is read by nothing: a misspelt `llm-platfrom:endpoint`
# would quietly leave the endpoint at its defaults.
CONFIG_NAMESPACES = {
    NAMESPACE: "this program",
    "aws": "the AWS provider and the program (aws:region)",
    "docker-build": "the provider that builds the serving image",
    "pulumi": "the Pulumi engine (pulumi:tags, pulumi:disable-default-providers)",
}


@dataclass(frozen=True)
class LoadedConfig:
    """The validated config and the secrets read beside it."""

    stack: StackConfig
    api_keys: pulumi.Output[str]


def _path(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(err: Mapping[str, Any]) -> str:
    msg = str(err["msg"])
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if err["type"] == "missing":
        return "required"
    value = err.get("input")
    if isinstance(value, (str, int, float, bool)) and err["type"] not in ("value_error",):
        return f"{msg} (got {json.dumps(value)})"
    return msg.removeprefix("Value error, ")


def parse(raw: Mapping[str, Any]) -> StackConfig:
    """Validate the raw config (section name -> value); raise ConfigError."""
    try:
        cfg = StackConfig.model_validate(dict(raw))
    except ValidationError as err:
        raise ConfigError([Problem(_path(e["loc"]) or "config", _describe(e)) for e in err.errors()]) from None
    problems = check_rules(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _all_config() -> dict[str, Any]:
    # pulumi.Config can only look keys up; listing them is how unknown
    # top-level keys are caught instead of silently ignored.
    from pulumi.runtime import config as runtime_config

    merged = dict(runtime_config.get_config_env())
    merged.update(runtime_config.CONFIG.get())
    return merged


def _secret_keys() -> set[str]:
    from pulumi.runtime import config as runtime_config

    return set(runtime_config.get_config_secret_keys_env()) | set(runtime_config._SECRET_KEYS.get())


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def split_api_keys(value: str) -> list[str]:
    """The keys in the secret: comma- or newline-separated."""
    return [k.strip() for k in re.split(r"[,\n]", value) if k.strip()]


def _check_api_keys(value: str) -> list[Problem]:
    """Each entry is `<id>:<secret>` (or a bare secret, whose id is its fingerprint), ids and secrets unique.

    Never echo a key: a message names the position, and the id where one is written.
    """
    out: list[Problem] = []
    ids: set[str] = set()
    secrets: set[str] = set()
    entries = split_api_keys(value)
    if not entries:
        return [Problem(SECRET_API_KEYS, "needs at least one key (<id>:<key>)")]
    for i, text in enumerate(entries, start=1):
        try:
            key = parse_entry(text, f"key {i}")
        except KeyFormatError as err:
            out.append(Problem(SECRET_API_KEYS, str(err)))
            continue
        named = f"key {i} ('{key.id}')" if key.explicit else f"key {i}"
        rules = [
            (len(key.secret) < API_KEY_MIN_LENGTH, f"is shorter than {API_KEY_MIN_LENGTH} characters"),
            (
                key.explicit and key.id == BATCH_WORKER_KEY_ID,
                f"uses the id '{BATCH_WORKER_KEY_ID}', the batch worker's own",
            ),
            (
                key.explicit and key.id.startswith(FINGERPRINT_PREFIX),
                f"uses an id starting '{FINGERPRINT_PREFIX}', kept for keys written without an id",
            ),
            (key.id in ids, "uses the id of another key"),
            (key.secret in secrets, "repeats another key"),
        ]
        out += [Problem(SECRET_API_KEYS, f"{named} {message}") for broken, message in rules if broken]
        ids.add(key.id)
        secrets.add(key.secret)
    return out


def _duplicate_keys(node: yaml.Node | None, path: str) -> Iterable[Problem]:
    """Every key a YAML mapping repeats: a YAML loader keeps only the last, silently."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            # The stack file's keys are named as Pulumi names them: without `config.`.
            inner = key if path in ("", "config") else f"{path}.{key}"
            if key in seen:
                yield Problem(
                    inner,
                    f"duplicate key (lines {seen[key]} and {line}): YAML would keep only the last, silently",
                )
            seen.setdefault(key, line)
            yield from _duplicate_keys(value_node, inner)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, f"{path}[{i}]")


def read_stack_file(path: Path) -> tuple[dict[str, str], list[str]]:
    """Pulumi config (key -> value as the CLI passes it) and its secret keys.

    Structured values reach a program as JSON strings, scalars as strings;
    `secure:` values can not be decrypted offline and become placeholders.
    """
    text = path.read_text()
    try:
        duplicates = list(_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), ""))
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([Problem(str(path), f"not valid YAML{where}")]) from None
    if duplicates:
        raise ConfigError(duplicates)
    raw = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(raw, dict):
        raise ConfigError([Problem(str(path), "needs a `config:` mapping")])
    config: dict[str, str] = {}
    secrets: list[str] = []
    for key, value in raw.items():
        if isinstance(value, dict) and set(value) == {"secure"}:
            config[key] = PLACEHOLDER_API_KEYS
            secrets.append(key)
        elif isinstance(value, (dict, list)):
            config[key] = json.dumps(value)
        elif isinstance(value, bool):
            config[key] = "true" if value else "false"
        else:
            config[key] = "" if value is None else str(value)
    return config, secrets


def sections(values: Mapping[str, str]) -> dict[str, Any]:
    """Pulumi's flat config (`namespace:key` -> string) as the sections `parse` takes.

    The one translation from what the CLI hands a program to the config
    model: the program (`load`), the render and the tests all go through it.
    """
    raw: dict[str, Any] = {}
    for key, value in sorted(values.items()):
        ns, _, name = key.partition(":")
        if ns == NAMESPACE and name != SECRET_API_KEYS:
            raw[name] = _decode(value)
    if "aws:region" in values:
        raw["region"] = values["aws:region"]
    return raw


def check_namespaces(keys: Iterable[str]) -> list[Problem]:
    """One problem per config key outside the namespaces something reads."""
    problems: list[Problem] = []
    for key in sorted(keys):
        namespace, colon, name = key.partition(":")
        if not (colon and namespace and name):
            problems.append(Problem(key, "not a config key: Pulumi config keys are <namespace>:<name>"))
        elif namespace not in CONFIG_NAMESPACES:
            close = difflib.get_close_matches(namespace, CONFIG_NAMESPACES, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(
                Problem(
                    key,
                    f"unknown config namespace '{namespace}'{hint}: nothing reads it "
                    f"(the namespaces read are {', '.join(CONFIG_NAMESPACES)})",
                )
            )
    return problems


def load_stack_file(path: Path) -> StackConfig:
    """A stack file (`Pulumi.<stack>.yaml`) as the validated config; raise ConfigError."""
    values, _ = read_stack_file(path)
    problems = check_namespaces(values)
    if problems:
        raise ConfigError(problems)
    return parse(sections(values))


def load() -> LoadedConfig:
    """Read, validate and return the stack's config; raise ConfigError."""
    values = _all_config()
    # A misspelt namespace leaves whole sections at their defaults: report
    # it alone, not the knock-on problems of the sections it hides.
    misplaced = check_namespaces(values)
    if misplaced:
        raise ConfigError(misplaced)
    raw = sections(values)
    region = pulumi.Config("aws").get("region")
    problems: list[Problem] = []
    if region is None:
        problems.append(Problem("aws:region", "required: pulumi config set aws:region <region>"))
    raw["region"] = region or "unset"
    try:
        cfg = parse(raw)
    except ConfigError as err:
        problems += err.problems
    keys = pulumi.Config(NAMESPACE).get_secret(SECRET_API_KEYS)
    full_key = f"{NAMESPACE}:{SECRET_API_KEYS}"
    if keys is None:
        problems.append(
            Problem(
                SECRET_API_KEYS,
                f"required: pulumi config set --secret {full_key} <key>[,<key>...]",
            )
        )
    elif full_key not in _secret_keys():
        problems.append(Problem(SECRET_API_KEYS, f"must be a secret: pulumi config set --secret {full_key} ..."))
    else:
        problems += _check_api_keys(str(_all_config().get(full_key, "")))
    if problems:
        raise ConfigError(problems)
    assert keys is not None
    return LoadedConfig(stack=cfg, api_keys=keys)
