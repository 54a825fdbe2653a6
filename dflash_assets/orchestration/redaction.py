"""Every event, log line and run tag a step writes goes through one redaction layer (`redaction.py`'s rule).

`@redacted`, under the `@asset` (or `@asset_check`) decorator of every step, puts a filter on the step's
log manager before the body runs: the messages of `context.log` and every Dagster event the step emits
(materialisation and observation metadata, check results, the failure's error and stack) are masked
before any handler or the event log sees them. An error raised with a secret in it leaves the body
masked, so the run's own failure event cannot carry it either. It also masks every Python log record
this process creates (the core's warnings, boto's), which end up in the compute logs. Run tags go
through `redacted_tags`, a manifest's fields through `redacted_fields`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from dflash_assets.redaction import environment_secrets, redact, redact_value

__all__ = ["redact", "redact_step", "redact_value", "redacted", "redacted_fields", "redacted_tags"]

Body = TypeVar("Body", bound=Callable[..., Any])


class RedactingFilter(logging.Filter):
    """Masks a record's message and, for a Dagster event, the whole event (via its serialised form, which
    reaches every field: metadata values, error messages, stack frames)."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = environment_secrets()
        _redact_message(record, secrets)
        event = getattr(record, "dagster_event", None)
        if event is not None:
            from dagster._serdes import deserialize_value, serialize_value

            text = serialize_value(event)
            masked = redact(text, secrets)
            if masked != text:
                record.dagster_event = deserialize_value(masked)
        return True


def _redact_message(record: logging.LogRecord, secrets: list[str]) -> None:
    try:
        message = record.getMessage()
    except (TypeError, ValueError):  # arguments that do not format: leave the record to fail as it would
        return
    masked = redact(message, secrets)
    if masked != message:
        record.msg, record.args = masked, ()


_FILTER = RedactingFilter()
_factory_installed = False


def redact_step(context: Any) -> None:
    """Mask everything the step's log manager writes from now on, and every Python log record of this
    process. Idempotent."""
    log = context.log
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    _install_record_factory()


def _install_record_factory() -> None:
    global _factory_installed
    if _factory_installed:
        return
    make_record = logging.getLogRecordFactory()

    def masked_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        _redact_message(record, environment_secrets())
        return record

    logging.setLogRecordFactory(masked_record)
    _factory_installed = True


def redacted_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """Run tags as they may be written."""
    secrets = environment_secrets()
    return {key: redact(value, secrets) for key, value in tags.items()}


def redacted_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Plain JSON fields (a manifest's) as they may be written."""
    return redact_value(dict(fields))


def redacted(body: Body) -> Body:
    """The step body with `redact_step` applied first and errors that name a secret masked on the way out.
    Dagster reads the body's signature through the wrapper (`functools.wraps`)."""

    def context_of(args: tuple, kwargs: dict) -> Any:
        return kwargs["context"] if "context" in kwargs else args[0]

    if inspect.isgeneratorfunction(body):

        @functools.wraps(body)
        def generator(*args: Any, **kwargs: Any) -> Iterator[Any]:
            redact_step(context_of(args, kwargs))
            with _masked_errors():
                yield from body(*args, **kwargs)

        return generator  # type: ignore[return-value]

    @functools.wraps(body)
    def function(*args: Any, **kwargs: Any) -> Any:
        redact_step(context_of(args, kwargs))
        with _masked_errors():
            return body(*args, **kwargs)

    return function  # type: ignore[return-value]


class RedactedError(RuntimeError):
    """An error whose message (or a cause of it) named a secret, raised again with it masked."""


@contextlib.contextmanager
def _masked_errors() -> Iterator[None]:
    try:
        yield
    except Exception as error:
        secrets = environment_secrets()
        whole = "".join(traceback.format_exception(error))
        if redact(whole, secrets) == whole:
            raise
        message = redact(str(error), secrets)
        try:
            masked: Exception = type(error)(message)
        except Exception:  # an error type that takes other arguments
            masked = RedactedError(f"{type(error).__name__}: {message}")
        masked.add_note("where it was raised (secrets masked):\n" + redact(whole, secrets))
        raise masked from None  # the original and its causes stay out of every event
