"""The reference pages of the documentation site, generated from the code (``docs/reference/``).

``python -m spendgate._docs_gen`` writes them; ``--check`` writes nothing and exits 1 naming
every page that differs from what the code gives (``tests/test_docs_reference.py`` runs the
same comparison in the suite, so a page cannot drift from the code it describes):

- ``settings.md``: every ``SPENDGATE_*`` variable, from the pydantic settings classes
  (:data:`SETTINGS`), and the few that scripts and the test suite read (:data:`OTHER_VARIABLES`);
- ``policy.md``: every policy field, from the policy JSON Schema (``schemas/json/policy.json``);
- ``metrics.md``: every Prometheus metric family of the metrics modules (:data:`METRICS`);
- ``exit-codes.md``: every exit code of every command (:data:`EXIT_CODES`, checked against the
  code's own constants and ``exit`` calls by the tests);
- ``cli.md``: the ``--help`` of every command, as the CLI prints it at 80 columns;
- ``openapi.json`` and ``http-api.md``: the admission service's OpenAPI document, as it serves
  it, and a page rendered from it.

It lives in the package beside what it reads (imported, never parsed), is type-checked with it,
and needs nothing the package does not already depend on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

__all__ = [
    "COMMAND",
    "EXIT_CODES",
    "METRICS",
    "OTHER_VARIABLES",
    "PAGES",
    "SETTINGS",
    "ExitCode",
    "MetricModule",
    "SettingsGroup",
    "main",
    "openapi",
    "render",
    "settings_variables",
]

#: The command that regenerates the pages (named in every page and every drift failure).
COMMAND = ".venv/bin/python -m spendgate._docs_gen"
#: Where the pages go, relative to the repository's root.
REFERENCE = Path("docs") / "reference"

_NOTE = (
    "*Generated from the code by `{command}` ({source}): edit the code, then run it again; "
    "a test fails while this page differs from what the code gives.*"
)


def _import(module: str) -> types.ModuleType:
    # litellm fetches its model cost map over the network at import unless told not to.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return importlib.import_module(module)


def _header(title: str, source: str) -> list[str]:
    return [f"# {title}", "", _NOTE.format(command=COMMAND, source=source), ""]


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell: ``|`` outside code spans escaped, one line."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's ``toc`` gives a heading."""
    value = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _code(value: str) -> str:
    return f"`{value}`" if "`" not in value else f"`` {value} ``"


# -- settings ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SettingsGroup:
    """One settings class and the section of ``settings.md`` that lists its own fields."""

    title: str
    module: str
    name: str
    #: Who reads these variables.
    readers: str

    def cls(self) -> type[BaseSettings]:
        """The class, imported."""
        found = getattr(_import(self.module), self.name)
        assert isinstance(found, type) and issubclass(found, BaseSettings), self
        return found


#: Every settings class, in the order of the page: the shared connection settings first.
SETTINGS: tuple[SettingsGroup, ...] = (
    SettingsGroup(
        "Kafka connection",
        "spendgate.schemas.kafka_connect",
        "KafkaSettings",
        "every Kafka client spendgate builds: the worker, admission, the dashboard, `policy`, "
        "`replay`, `simulate`, `alerts tail` and the demo",
    ),
    SettingsGroup(
        "Redis connection",
        "spendgate.schemas.redis_connect",
        "RedisSettings",
        "every Redis client spendgate builds: the worker, admission, the dashboard, `replay`, "
        "`budgets` and `dev status`",
    ),
    SettingsGroup(
        "Key ids",
        "spendgate.schemas.key_settings",
        "SubjectSecretSettings",
        "the worker, admission, `policy apply`, `replay`, `simulate`, `key-id`, the demo and "
        "the LiteLLM callback (the same values everywhere)",
    ),
    SettingsGroup(
        "Worker",
        "spendgate.streams.settings",
        "WorkerSettings",
        "`spendgate worker`; `replay`, `simulate`, `budgets`, `alerts tail`, `key-id` and "
        "`dev status` read them too",
    ),
    SettingsGroup(
        "Policy commands",
        "spendgate.streams.policy_admin",
        "PolicySettings",
        "`spendgate policy apply`, `list` and `delete`",
    ),
    SettingsGroup(
        "Admission",
        "spendgate.admission.settings",
        "AdmissionSettings",
        "`spendgate admission`; `dev status` reads them too",
    ),
    SettingsGroup(
        "Dashboard", "spendgate.dashboard.settings", "DashboardSettings", "`spendgate dashboard`"
    ),
    SettingsGroup(
        "LiteLLM callback",
        "spendgate.integrations.litellm",
        "LiteLLMSettings",
        "the callback inside a LiteLLM proxy (`spendgate.integrations.litellm.handler`), on "
        "its first request",
    ),
    SettingsGroup(
        "Local stack",
        "spendgate.devstack",
        "StackSettings",
        "`spendgate dev up`, `down` and `status` (the one-broker stack)",
    ),
    SettingsGroup(
        "Local Kafka cluster",
        "spendgate.devkafka",
        "KafkaClusterSettings",
        "`spendgate dev up|env|down|status --brokers N` and `--security sasl_ssl`",
    ),
    SettingsGroup(
        "Local Redis Cluster",
        "spendgate.devcluster",
        "ClusterSettings",
        "`spendgate dev cluster up`, `down` and `status`",
    ),
)

#: Variables no settings class reads: the scripts' and the test suite's own.
#: Each: who reads it, its default, what it does.
OTHER_VARIABLES: dict[str, tuple[str, str, str]] = {
    "SPENDGATE_SETUP_NEXT": (
        "`scripts/setup`",
        "`1`",
        "`1`: end by printing the two commands to run next; `scripts/demo` and `scripts/test` "
        "set `0`.",
    ),
    "SPENDGATE_TEST_WORKERS": (
        "`scripts/test`",
        "`2`",
        "pytest-xdist workers of the suite's parallel part (`0`: everything serially in one "
        "pytest).",
    ),
    "SPENDGATE_TEST_SEED": (
        "the test suite",
        "a new seed each run",
        "The seed every random input of a run derives from (printed in the pytest header and "
        "beside each failure): set it to reproduce a run.",
    ),
    "SPENDGATE_TEST_EVENTS": (
        "the test suite",
        "`50000`",
        "Events of the randomized run against an exact oracle.",
    ),
    "SPENDGATE_TEST_NO_SERVICES": (
        "`scripts/test-fast`",
        "none",
        "`1`: a test asking for Kafka or Redis fails instead of starting them.",
    ),
    "SPENDGATE_TEST_HANG_FILE": (
        "the test suite (`tests/fixtures/hung_worker.py`)",
        "none",
        "Once this file exists, the test worker's produce requests get no answer.",
    ),
    "SPENDGATE_TEST_HANG_TOPICS": (
        "the test suite (`tests/fixtures/hung_worker.py`)",
        "none",
        "The topics (comma-separated; empty: any) whose produce requests hang.",
    ),
    "SPENDGATE_TEST_BLOCK_FILE": (
        "the test suite (`tests/fixtures/hung_worker.py`)",
        "none",
        "Once this file exists, the test worker's event loop is blocked.",
    ),
    "SPENDGATE_FAULTS_RESULTS": (
        "the fault suite (`tests/faults/`)",
        "a temporary folder",
        "Where each fault test writes the figures it recorded (`tests.faults.report` sets it).",
    ),
}


def _own_fields(cls: type[BaseModel]) -> dict[str, FieldInfo]:
    """The fields ``cls`` declares itself (not those it inherits unchanged)."""
    inherited: set[str] = set()
    for base in cls.__mro__[1:]:
        if isinstance(base, type) and issubclass(base, BaseModel) and base is not BaseModel:
            inherited.update(base.model_fields)
    own = set(vars(cls).get("__annotations__", {}))
    return {n: f for n, f in cls.model_fields.items() if n in own or n not in inherited}


def _variable(cls: type[BaseSettings], field: str) -> str:
    prefix = str(cls.model_config.get("env_prefix", ""))
    return f"{prefix}{field}".upper()


def settings_variables() -> dict[str, list[str]]:
    """Every variable the settings classes read -> the titles of the groups that read it."""
    found: dict[str, list[str]] = {}
    for group in SETTINGS:
        cls = group.cls()
        for name in cls.model_fields:
            titles = found.setdefault(_variable(cls, name), [])
            if group.title not in titles:
                titles.append(group.title)
    return found


def _home_relative(value: Path) -> str:
    home = Path.home()
    if value == home or home in value.parents:
        return str(Path("~") / value.relative_to(home))
    return str(value)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        factory = typing.cast(Callable[[], Any], field.default_factory)
        return _code(json.dumps(factory(), separators=(", ", ": ")))
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return _code("true" if value else "false")
    if isinstance(value, Path):
        return _code(_home_relative(value))
    if isinstance(value, str) and value == "":
        return '`""` (empty)'
    return _code(str(value))


def _bounds(metadata: Sequence[Any]) -> str:
    said = []
    for item in metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            bound = getattr(item, attr, None)
            if bound is not None:
                said.append(f"{sign} {bound}")
    return ", ".join(said)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        if base is str and any(getattr(e, "pattern", None) for e in extra):
            return "duration"
        if base is bool:
            return "`true` \\| `false`"
        return _type_name(base)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " or ".join(_type_name(a) for a in kinds)
    if origin is typing.Literal:
        return " \\| ".join(_code(str(v)) for v in typing.get_args(annotation))
    if origin is dict:
        return "JSON object"
    names = {
        bool: "`true` \\| `false`",
        int: "integer",
        float: "number",
        str: "string",
        Path: "path",
        SecretStr: "secret",
    }
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _setting_type(field: FieldInfo) -> str:
    kind = _type_name(field.annotation)
    if kind == "duration":
        kind = "duration (`500ms`, `30s`, `5m`, `1h`, `2d`)"
    bounds = _bounds(field.metadata)
    return f"{kind}, {bounds}" if bounds else kind


def _settings_page() -> str:
    lines = _header("Settings", "the pydantic settings classes")
    lines += [
        "Every setting is an environment variable. A settings class reads its variables when "
        "its process starts (never at import); a value it refuses stops the process with one "
        "`error:` line naming the variable (exit 2). Booleans take `true` or `false` in any "
        "case, durations a whole number and a unit (`ms`, `s`, `m`, `h`, `d`).",
        "",
        "## All variables",
        "",
        "| variable | default | section |",
        "|---|---|---|",
    ]
    rows: dict[str, tuple[list[str], list[str]]] = {}
    for group in SETTINGS:
        cls = group.cls()
        for name, field in _own_fields(cls).items():
            defaults, sections = rows.setdefault(_variable(cls, name), ([], []))
            defaults.append(_default(field))
            sections.append(group.title)
    for name, (_, default, _) in OTHER_VARIABLES.items():
        rows[name] = ([default], ["Scripts and tests"])
    for name in sorted(rows):
        defaults, sections = rows[name]
        default = defaults[0] if len(set(defaults)) == 1 else "by section"
        links = ", ".join(f"[{t}](#{_slug(t)})" for t in sections)
        lines.append(f"| `{name}` | {default} | {links} |")
    for group in SETTINGS:
        cls = group.cls()
        shared = [
            g.title
            for g in SETTINGS
            if g is not group and g.cls() is not cls and issubclass(cls, g.cls())
        ]
        lines += ["", f"## {group.title}", ""]
        lines.append(f"Read by {group.readers} (`{group.module}.{group.name}`).")
        if shared:
            also = ", ".join(f"[{t}](#{_slug(t)})" for t in shared)
            lines.append(f"These processes also read the variables of {also}.")
        lines += ["", "| variable | default | type | description |", "|---|---|---|---|"]
        for name, field in _own_fields(cls).items():
            description = field.description or ""
            lines.append(
                f"| `{_variable(cls, name)}` | {_default(field)} | {_setting_type(field)} "
                f"| {_cell(description)} |"
            )
    lines += [
        "",
        "## Scripts and tests",
        "",
        "Read by the scripts and the test suite, never by a spendgate process.",
        "",
        "| variable | read by | default | description |",
        "|---|---|---|---|",
    ]
    for name, (reader, default, description) in sorted(OTHER_VARIABLES.items()):
        lines.append(f"| `{name}` | {reader} | {default} | {_cell(description)} |")
    return "\n".join(lines) + "\n"


# -- policy --------------------------------------------------------------------------------


def _pattern(pattern: str) -> str:
    """A string pattern as a reader wants it: a subject field's names listed."""
    names = re.fullmatch(r"\^\(([a-z_|]+)\|labels\\\.\.\+\)\$", pattern)
    if names is None:
        return f"string matching `{pattern}`"
    fields = [*names.group(1).split("|"), "labels.NAME"]
    return "subject field (" + ", ".join(f"`{f}`" for f in fields) + ")"


def _schema_type(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in prop:
        name = str(prop["$ref"]).rsplit("/", 1)[-1]
        return f"object ([{name.lower()}](#{_slug(name)}))"
    if "anyOf" in prop:
        kinds = [_schema_type(p, defs) for p in prop["anyOf"] if p.get("type") != "null"]
        return " or ".join(kinds)
    if "enum" in prop:
        return " \\| ".join(_code(str(v)) for v in prop["enum"])
    kind = str(prop.get("type", "any"))
    if kind == "string" and prop.get("pattern") == r"^([0-9]+)(ms|s|m|h|d)$":
        return "duration"
    if kind == "string" and "pattern" in prop:
        return _pattern(str(prop["pattern"]))
    if kind == "array":
        item = _schema_type(prop.get("items", {}), defs)
        return f"list of {item.replace('subject field', 'subject fields', 1)}"
    if kind == "object" and "propertyNames" in prop:
        return f"object: {_pattern(str(prop['propertyNames']['pattern']))} -> string"
    limits = []
    if "exclusiveMinimum" in prop:
        limits.append(f"> {prop['exclusiveMinimum']}")
    if "minimum" in prop:
        limits.append(f">= {prop['minimum']}")
    if "maximum" in prop:
        limits.append(f"<= {prop['maximum']}")
    if "maxLength" in prop:
        limits.append(f"{prop.get('minLength', 0)} to {prop['maxLength']} characters")
    return f"{kind} ({', '.join(limits)})" if limits else kind


def _schema_default(name: str, prop: dict[str, Any], model: type[BaseModel]) -> str:
    if "default" in prop:
        value = prop["default"]
        if value is None:
            return "none"
        return _code(json.dumps(value) if not isinstance(value, str) else value)
    field = model.model_fields.get(name)
    if field is not None and not field.is_required():
        return _default(field)
    return "required"


def _properties_table(
    schema: dict[str, Any], defs: dict[str, Any], model: type[BaseModel]
) -> list[str]:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    # In the model's order (the schema's is alphabetical): the required fields come first.
    order = {name: n for n, name in enumerate(model.model_fields)}
    properties = sorted(schema["properties"].items(), key=lambda item: order.get(item[0], 0))
    for name, prop in properties:
        description = prop.get("description", "")
        lines.append(
            f"| `{name}` | {_schema_type(prop, defs)} | {_schema_default(name, prop, model)} "
            f"| {_cell(description)} |"
        )
    return lines


def _policy_page() -> str:
    from spendgate.schemas.jsonschema import rendered
    from spendgate.schemas.policies import Burst, Policy

    schema = json.loads(rendered()["policy.json"])
    defs: dict[str, Any] = schema.get("$defs", {})
    lines = _header("Policy", "the policy JSON Schema, `schemas/json/policy.json`")
    lines += [
        "A policy file (YAML or JSON) holds one policy or a list; `spendgate policy apply FILE` "
        "validates every policy and publishes them, or refuses the file naming each invalid "
        "field. Unknown fields are refused. The JSON Schema is checked in as "
        "`schemas/json/policy.json` (`spendgate schema export` writes it).",
        "",
        "```yaml",
        "- id: tenant-tokens-1m",
        '  match: {model: "claude-*"}',
        "  group_by: [tenant]",
        "  unit: total_tokens",
        "  limit: 60000",
        "  window: 1m",
        "  bucket: 5s",
        "```",
        "",
        "Required: " + ", ".join(f"`{n}`" for n in schema.get("required", [])) + ".",
        "",
        "## Fields",
        "",
    ]
    lines += _properties_table(schema, defs, Policy)
    if "Burst" in defs:
        lines += ["", "## Burst", "", _cell(Burst.__doc__ or "").replace("``", "`"), ""]
        lines += _properties_table(defs["Burst"], defs, Burst)
    lines += [
        "",
        "## Durations",
        "",
        "A duration is a whole number and a unit: `ms`, `s`, `m`, `h` or `d` (`500ms`, `30s`, "
        "`5m`, `1h`, `7d`).",
    ]
    return "\n".join(lines) + "\n"


# -- metrics -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MetricModule:
    """A module defining Prometheus metrics, and where its process exposes them."""

    title: str
    module: str
    exposed: str


#: Every module that defines Prometheus metrics.
METRICS: tuple[MetricModule, ...] = (
    MetricModule(
        "Worker",
        "spendgate.streams.metrics",
        "`spendgate worker` on `http://SPENDGATE_METRICS_HOST:SPENDGATE_METRICS_PORT/metrics` "
        "(default `127.0.0.1:9464`)",
    ),
    MetricModule(
        "Admission",
        "spendgate.admission.metrics",
        "`spendgate admission` on `/metrics` of its HTTP port (default `127.0.0.1:8787`)",
    ),
    MetricModule(
        "LiteLLM callback",
        "spendgate.integrations.litellm",
        "a LiteLLM proxy running the callback, in the proxy's own Prometheus registry",
    ),
)


def metric_families(module: str) -> Iterator[Any]:
    """The Prometheus metrics ``module`` defines, in definition order."""
    from prometheus_client.metrics import MetricWrapperBase

    for value in vars(_import(module)).values():
        if isinstance(value, MetricWrapperBase):
            yield value


def exposed_name(metric: Any) -> str:
    """The family's name as a scrape shows it (a counter's with ``_total``)."""
    name = str(metric._name)
    return f"{name}_total" if metric._type == "counter" else name


def _metrics_page() -> str:
    lines = _header("Metrics", "the Prometheus metrics modules")
    lines += [
        "Every Prometheus metric family spendgate exports, with its type, labels and help. "
        "A histogram's samples are `<name>_bucket{le}`, `<name>_sum` and `<name>_count`.",
    ]
    for where in METRICS:
        lines += [
            "",
            f"## {where.title}",
            "",
            f"Exposed by {where.exposed} (`{where.module}`).",
            "",
        ]
        lines += ["| metric | type | labels | help |", "|---|---|---|---|"]
        for metric in metric_families(where.module):
            labels = ", ".join(f"`{label}`" for label in metric._labelnames) or "none"
            kind = str(metric._type)
            if kind == "histogram":
                bounds = [b for b in metric._upper_bounds if b != float("inf")]
                kind += " (buckets " + ", ".join(f"{b:g}" for b in bounds) + ")"
            lines.append(
                f"| `{exposed_name(metric)}` | {kind} | {labels} | {_cell(metric._documentation)} |"
            )
    return "\n".join(lines) + "\n"


# -- exit codes ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExitCode:
    """One exit status of one command (or of every command: ``spendgate``)."""

    command: str
    code: int
    meaning: str


def _worker_stalled() -> int:
    from spendgate.streams.liveness import EXIT_STALLED

    return EXIT_STALLED


#: Every exit status, by command. The tests hold it to the code: each ``exit`` call and
#: ``EXIT_*`` constant of the commands' modules must be listed here.
EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode("every `spendgate` command", 0, "done"),
    ExitCode(
        "every `spendgate` command",
        1,
        "an unexpected failure (a traceback), or a check the command names below failed",
    ),
    ExitCode(
        "every `spendgate` command",
        2,
        "refused before doing anything: a bad option or argument (a usage line), or a setting "
        "or input refused (one `error:` line naming the variable, field or file)",
    ),
    ExitCode(
        "every `spendgate` command",
        3,
        "gave up waiting (one `error:` line naming the step): `policy apply`, `delete` and "
        "`list` after `SPENDGATE_POLICY_TIMEOUT_S`, `dev up` after its start timeout",
    ),
    ExitCode("`spendgate worker`", 0, "stopped by a signal (SIGTERM, SIGINT)"),
    ExitCode(
        "`spendgate worker`",
        1,
        "stopped without a signal (a faust service that ended by itself), or a failure: for "
        "its supervisor to start it again",
    ),
    ExitCode(
        "`spendgate worker`",
        2,
        "a setting refused at start (one `error:` line naming the variable: a bound of 0, "
        "bounds out of order, a `usage` topic whose retention is too short, an "
        "under-replicated topic, credentials the broker or Redis refuses)",
    ),
    ExitCode(
        "`spendgate worker`",
        _worker_stalled(),
        "no progress within `SPENDGATE_WORKER_EXIT_S`, or a stop that outlasted "
        "`SPENDGATE_WORKER_STOP_GRACE_S` (one CRITICAL `worker exits 4:` line after the "
        "diagnostics); its records come again from the committed offsets",
    ),
    ExitCode(
        "`spendgate admission`, `spendgate dashboard`",
        2,
        "refusing to listen beyond loopback without a tokens file (one line saying how to "
        "fix it), a tokens file others may read, or a setting refused",
    ),
    ExitCode("`spendgate replay --verify`", 1, "Redis differs from the rebuilt windows"),
    ExitCode(
        "`spendgate demo`",
        1,
        "the run did not show every showcased behaviour (the line names what is missing)",
    ),
    ExitCode("`python -m bench.<name> --check`", 1, "a target of the benchmark was not met"),
    ExitCode(
        "`bash scripts/demo`, `bash scripts/test`, `.ci/run`",
        1,
        "a step failed (the demo's or pytest's own status otherwise)",
    ),
)


def _exit_codes_page() -> str:
    lines = _header("Exit codes", "the table in `spendgate/_docs_gen.py`, held to the code")
    lines += [
        "What each command's exit status means. A supervisor restarting on failure "
        "(`Restart=on-failure`, `restartPolicy: Always`) starts `spendgate worker` again "
        "after 1 and 4; 2 needs a fix first.",
        "",
        "| command | exit | meaning |",
        "|---|---|---|",
    ]
    for entry in EXIT_CODES:
        lines.append(f"| {entry.command} | {entry.code} | {_cell(entry.meaning)} |")
    return "\n".join(lines) + "\n"


# -- the command line ----------------------------------------------------------------------

#: The width the CLI's help is rendered at (a terminal's).
CLI_WIDTH = 80


def _commands() -> Iterator[tuple[str, str]]:
    """Every command path (``spendgate dev up``) with its ``--help``, depth first.

    Typed loosely: typer builds its commands on the click it vendors (``typer._click``), so
    each context is made by the command's own ``context_class``.
    """
    import typer

    from spendgate.cli import app

    def walk(cmd: Any, name: str, parent: Any) -> Iterator[tuple[str, str]]:
        ctx = cmd.context_class(
            cmd,
            info_name=name,
            parent=parent,
            terminal_width=CLI_WIDTH,
            max_content_width=CLI_WIDTH,
        )
        path = " ".join(c.info_name or "" for c in reversed(list(_lineage(ctx))))
        yield path, str(cmd.get_help(ctx))
        if hasattr(cmd, "list_commands"):
            for sub in cmd.list_commands(ctx):
                child = cmd.get_command(ctx, sub)
                if child is not None and not child.hidden:
                    yield from walk(child, sub, ctx)

    yield from walk(typer.main.get_command(app), "spendgate", None)


def _lineage(ctx: Any) -> Iterator[Any]:
    while ctx is not None:
        yield ctx
        ctx = ctx.parent


def _cli_page() -> str:
    lines = _header("Command line", "the `--help` of every command")
    lines += [
        "Every command's `--help`, as the CLI prints it at 80 columns. Commands read their "
        "settings from the environment ([Settings](settings.md)); their exit statuses are in "
        "[Exit codes](exit-codes.md).",
    ]
    home = str(Path.home())
    for path, help_text in _commands():
        lines += ["", f"## {path}", "", "```text", help_text.replace(home, "~").rstrip(), "```"]
    return "\n".join(lines) + "\n"


# -- the HTTP API --------------------------------------------------------------------------


def openapi() -> dict[str, Any]:
    """The OpenAPI document the admission service serves at ``/openapi.json``."""
    from spendgate.admission.server import build_app
    from spendgate.admission.settings import AdmissionSettings

    # The document depends on the code only: the defaults (not this environment) name where
    # to connect, and nothing connects until the app's lifespan starts.
    return build_app(AdmissionSettings.model_construct()).openapi()


def _openapi_json() -> str:
    return json.dumps(openapi(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _ref_link(ref: str) -> str:
    name = ref.rsplit("/", 1)[-1]
    return f"[{name}](#{_slug(name)})"


def _api_type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return _ref_link(str(prop["$ref"]))
    if "anyOf" in prop:
        kinds = [_api_type(p) for p in prop["anyOf"] if p.get("type") != "null"]
        nullable = any(p.get("type") == "null" for p in prop["anyOf"])
        return " or ".join(kinds) + (" or null" if nullable else "")
    if "enum" in prop:
        return " \\| ".join(_code(json.dumps(v)) for v in prop["enum"])
    if "const" in prop:
        return _code(json.dumps(prop["const"]))
    kind = str(prop.get("type", "any"))
    if kind == "array":
        return f"list of {_api_type(prop.get('items', {}))}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"object of {_api_type(prop['additionalProperties'])}"
    return kind


def _doc_text(text: str) -> str:
    """A docstring as Markdown: reST's double backticks as code spans, one paragraph."""
    return " ".join(text.replace("``", "`").split())


def _http_page() -> str:
    doc = openapi()
    lines = _header(
        "HTTP API", "the admission service's OpenAPI document, [openapi.json](openapi.json)"
    )
    lines += [
        _doc_text(str(doc["info"].get("description", ""))),
        "",
        "The service serves the same document at `/openapi.json` and interactive docs at "
        "`/docs`; with auth on, every `/v1` call carries `Authorization: Bearer <token>`.",
    ]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            lines += ["", f"## {method.upper()} {path}", "", _doc_text(str(op.get("summary", "")))]
            if op.get("description"):
                lines += ["", _doc_text(str(op["description"]))]
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            if body:
                lines += ["", f"Body: {_api_type(body.get('schema', {}))}."]
            params = op.get("parameters", [])
            if params:
                names = ", ".join(f"`{p['name']}`" for p in params)
                lines += ["", f"Query parameters: {names}."]
            lines += ["", "| status | meaning | body |", "|---|---|---|"]
            for status, answer in op.get("responses", {}).items():
                content = answer.get("content", {})
                schema = content.get("application/json", {}).get("schema")
                shown = _api_type(schema) if schema else ", ".join(f"`{c}`" for c in content)
                lines.append(
                    f"| {status} | {_cell(str(answer.get('description', '')))} | {shown} |"
                )
    lines += ["", "## Bodies"]
    for name, schema in doc.get("components", {}).get("schemas", {}).items():
        lines += ["", f"### {name}", ""]
        if schema.get("description"):
            lines += [_doc_text(str(schema["description"])), ""]
        props = schema.get("properties", {})
        if not props:
            lines.append(f"Type: {_api_type(schema)}.")
            continue
        required = set(schema.get("required", []))
        lines += ["| field | type | required | description |", "|---|---|---|---|"]
        for field, prop in props.items():
            needed = "yes" if field in required else "no"
            described = _cell(_doc_text(str(prop.get("description", ""))))
            lines.append(f"| `{field}` | {_api_type(prop)} | {needed} | {described} |")
    return "\n".join(lines) + "\n"


# -- the pages -----------------------------------------------------------------------------

#: Each page (its file name under ``docs/reference/``) and its renderer.
PAGES: dict[str, Callable[[], str]] = {
    "settings.md": _settings_page,
    "policy.md": _policy_page,
    "metrics.md": _metrics_page,
    "exit-codes.md": _exit_codes_page,
    "cli.md": _cli_page,
    "http-api.md": _http_page,
    "openapi.json": _openapi_json,
}


def render(names: Sequence[str] | None = None) -> dict[str, str]:
    """The pages' text as the code gives it, by file name (all pages unless ``names``)."""
    return {name: PAGES[name]() for name in (names or PAGES)}


def main(argv: Sequence[str] | None = None) -> int:
    """Write the reference pages, or with ``--check`` compare them; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m spendgate._docs_gen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="Compare only; exit 1 on a drift.")
    parser.add_argument(
        "--root", type=Path, default=Path.cwd(), help="The repository (default: here)."
    )
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.root / REFERENCE / name
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        if args.check:
            stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run {COMMAND}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
