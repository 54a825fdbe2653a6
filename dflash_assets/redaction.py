"""What counts as a secret, and how text that may hold one is masked: the one rule every output uses.

Secrets are read from the environment when text is masked, never copied anywhere: the values of the
variables that hold credentials (AWS secret keys and session tokens, the inference servers' API key,
database passwords, and any `*_PASSWORD`, `*_SECRET`, `*_TOKEN` or `*_API_KEY`), and every password
written inside a URL in the environment (`redis://:password@host`, `amqp://user:password@host`). In
text, each is replaced by `***`, and so is the password of any `scheme://user:password@host` URL.

A leaf: it imports nothing of this package. The Dagster layer applies it to every event, log line and
run tag of a step (`orchestration/redaction.py`); the core applies it where it names a URL.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

MASK = "***"
# Variables known to hold a credential.
SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "DFLASH_GENERATE_API_KEY",
    "OPENAI_API_KEY",
    "DAGSTER_PG_PASSWORD",
    "PGPASSWORD",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
)
_SECRET_SUFFIXES = ("_PASSWORD", "_SECRET", "_SECRET_KEY", "_TOKEN", "_API_KEY")
# Shorter values would mask common words and numbers everywhere; no real credential is that short.
MIN_SECRET_LENGTH = 4
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:)(?P<password>[^\s/@]+)@")


def environment_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every secret value the environment holds now, longest first (so a secret containing another is
    masked whole)."""
    env = os.environ if environ is None else environ
    found: set[str] = set()
    for name, value in env.items():
        if not value:
            continue
        if name in SECRET_VARIABLES or name.upper().endswith(_SECRET_SUFFIXES):
            found.add(value)
        found.update(match.group("password") for match in _URL_PASSWORD.finditer(value))
    return sorted((s for s in found if len(s) >= MIN_SECRET_LENGTH), key=len, reverse=True)


def redact(text: str, secrets: list[str] | None = None) -> str:
    """`text` with every secret (as written, URL-quoted or JSON-escaped) and every URL password masked."""
    if not text:
        return text
    for secret in environment_secrets() if secrets is None else secrets:
        for form in {secret, quote(secret, safe=""), json.dumps(secret)[1:-1]}:
            if form in text:
                text = text.replace(form, MASK)
    return _URL_PASSWORD.sub(lambda match: match.group("head") + MASK + "@", text)


def redact_value(value: Any, secrets: list[str] | None = None) -> Any:
    """`redact` through strings, lists, tuples and dict keys and values; anything else as it is."""
    secrets = environment_secrets() if secrets is None else secrets
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, Mapping):
        return {redact_value(k, secrets): redact_value(v, secrets) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(redact_value(item, secrets) for item in value)
    return value
