"""The subject secret and the secret fields, as every service's settings read them."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from spendgate.schemas.exceptions import ConfigurationError
from spendgate.schemas.key_ids import KeyIds, secret_fields

__all__ = [
    "MIN_SECRET_BYTES",
    "SubjectSecretSettings",
    "announce",
    "read_private_file",
    "readable_files",
    "secret_or_file",
    "settings_error",
]

#: The shortest subject secret taken: a short one could be guessed from a known key's id.
MIN_SECRET_BYTES = 16
#: The mode bits that make a secret file shared: its group writing it, others doing anything.
_SHARED_BITS = stat.S_IWGRP | stat.S_IRWXO


def read_private_file(path: Path, what: str) -> bytes:
    """Read a file that holds secrets, refusing it when others may read or write it.

    The owner and its group may read it (0600, 0640, 0400, 0440: the modes a Kubernetes
    Secret volume gives with ``defaultMode: 0440`` and an ``fsGroup``); only the owner may
    write it, and others may do nothing with it (0644, 0666, 0604, 0660 are refused).

    Args:
        path: the file.
        what: what it holds, for the messages (``"the auth tokens file"``).

    Raises:
        ConfigurationError: the file cannot be read, or its mode lets others read or write
            it or its group write it: one line naming the fix (``chmod 600``, or a Secret
            volume's ``defaultMode: 0440``); it never shows the content.
    """
    try:
        mode = path.stat().st_mode
        if mode & _SHARED_BITS:
            raise ConfigurationError(
                f"{path}: {what} is readable or writable by others "
                f"(mode {stat.filemode(mode)}; the owner and its group may read it, only the "
                f"owner write it); run: chmod 600 {path} (or 640, 440; in a Kubernetes Secret "
                "volume: defaultMode: 0440)"
            )
        return path.read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"{path}: cannot read {what}: {exc.strerror}") from exc


def secret_or_file(value: SecretStr | None, path: Path | None, variable: str) -> SecretStr | None:
    r"""A secret given in ``variable`` or in the file of ``variable``\ ``_FILE`` (mode 600, 640,
    400 or 440; surrounding whitespace ignored); None for neither.

    Raises:
        ConfigurationError: both are set, or the file is unreadable or shared.
    """
    if value is not None and path is not None:
        raise ConfigurationError(f"set {variable} or {variable}_FILE, not both")
    if path is None:
        return value
    return SecretStr(read_private_file(path, f"the file of {variable}").decode().strip())


def readable_files(files: Iterable[tuple[str, Path | None]]) -> None:
    """Refuse, naming the variable, any of ``files`` (variable, path: None for unset) that
    is missing or unreadable: before any client tries it.

    Raises:
        ConfigurationError: naming the variable and the file.
    """
    for variable, path in files:
        if path is not None and (not path.is_file() or not os.access(path, os.R_OK)):
            raise ConfigurationError(f"{variable}={path}: no such readable file")


def settings_error(exc: ValidationError, env_prefix: str | None = None) -> ConfigurationError:
    """One line of every message of a model's validation (the variables they name); with
    ``env_prefix``, a message about one field starts with its variable's name."""

    def line(error: Any) -> str:
        msg = str(error["msg"]).removeprefix("Value error, ")
        if env_prefix is None or not error["loc"]:
            return msg
        return f"{env_prefix}{str(error['loc'][0]).upper()}: {msg}"

    return ConfigurationError("; ".join(line(e) for e in exc.errors()))


class SubjectSecretSettings(BaseSettings):
    """The settings that make key ids (``schemas.key_ids``), shared by every service."""

    model_config = SettingsConfigDict(env_prefix="SPENDGATE_", frozen=True, extra="ignore")

    subject_secret: SecretStr | None = Field(
        None,
        description="The HMAC key of the key ids (every service of a deployment must share "
        "it; at least 16 bytes); or `SPENDGATE_SUBJECT_SECRET_FILE`. Neither: the public "
        "built-in secret, with a warning.",
    )
    subject_secret_file: Path | None = Field(
        None,
        description="A file holding the subject secret (mode 600, 640, 400 or 440: others may "
        "not read it; surrounding whitespace ignored).",
    )
    secret_fields: str = Field(
        "api_key",
        description="Comma-separated subject fields stored only as key ids (`api_key`, "
        "`team`, `project`, `user`, `env`, `labels.NAME`; empty: none).",
    )

    def key_ids(self) -> KeyIds:
        """The key ids these settings describe.

        Raises:
            ConfigurationError: both or a bad secret, an unreadable or shared secret file, or
                a field that cannot be secret.
        """
        fields = secret_fields(self.secret_fields)
        if self.subject_secret is not None and self.subject_secret_file is not None:
            raise ConfigurationError(
                "set SPENDGATE_SUBJECT_SECRET or SPENDGATE_SUBJECT_SECRET_FILE, not both"
            )
        if self.subject_secret_file is not None:
            secret = read_private_file(self.subject_secret_file, "the subject secret file")
            where = str(self.subject_secret_file)
        elif self.subject_secret is not None:
            secret = self.subject_secret.get_secret_value().encode()
            where = "SPENDGATE_SUBJECT_SECRET"
        else:
            return KeyIds.built_in_secret(fields)
        secret = secret.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigurationError(
                f"{where}: the subject secret must be at least {MIN_SECRET_BYTES} bytes "
                "(generate one: python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        return KeyIds(secret, fields)


def announce(key_ids: KeyIds, logger: logging.Logger) -> None:
    """Log, once at a service's start, which key ids it makes (a warning under the built-in
    secret); the fingerprint lets an operator check that every service shares the secret."""
    if not key_ids.fields:
        logger.warning("SPENDGATE_SECRET_FIELDS is empty: subject values are stored as sent")
    elif key_ids.built_in:
        logger.warning(
            "subject fields %s are hashed with the PUBLIC built-in secret (key ids sgk_%s_...): "
            "anyone holding a key can recompute its id; set SPENDGATE_SUBJECT_SECRET_FILE",
            ",".join(key_ids.fields),
            key_ids.fingerprint,
        )
    else:
        logger.info(
            "subject fields %s are stored as key ids sgk_%s_...",
            ",".join(key_ids.fields),
            key_ids.fingerprint,
        )
