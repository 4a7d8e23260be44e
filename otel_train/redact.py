"""Secrets never reach a record, a file or a message (docs/settings.md, "Redaction").

What counts as a secret:

- an environment variable or command-line flag whose *name* contains one of ``SECRET_NAME_PARTS``
  (``TOKEN``, ``KEY``, ``SECRET``, ``PASS``, ``PWD``, ``CREDENTIAL``, ``AUTH``, ``COOKIE``, ``SESSION``;
  any case, ``-`` and ``.`` read as ``_``) or ends in ``_HEADERS`` (OTLP headers carry tokens): its
  whole value; on the command line that is the next argument (``--api-key SECRET``) or the part after
  ``=`` (``--password=SECRET``, Hydra's ``db.password=SECRET``);
- the ``user:password@`` part of a URL, anywhere in any value or message;
- whatever the ``redact`` setting adds: more name parts, and ``re:<pattern>`` regular expressions
  whose matches anywhere in a value are replaced (e.g. ``re:hf_[A-Za-z0-9]{30,}``).

Every record the runtime writes passes through :meth:`Redactor.record` (URL userinfo and the ``re:``
patterns, in every string of the record); ``process_start`` also gets the name rules (env, argv).

Pure: no OTel, no files. Readers and the runtime both use it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

import msgspec

REDACTED = "<redacted>"
_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode
SECRET_NAME_PARTS = ("TOKEN", "KEY", "SECRET", "PASS", "PWD", "CREDENTIAL", "AUTH", "COOKIE", "SESSION")
PATTERN_PREFIX = "re:"

# scheme://user:password@host: everything between "://" and the last "@" before the host's end.
_URL_USERINFO = re.compile(r"(?<=://)[^/\s@]*(?:@[^/\s@]*)*@")
_NAME_CHARS = re.compile(r"[-.]")
# --flag=value, -f=value, and key=value (Hydra overrides).
# Hydra also spells overrides +key=value (add) and ++key=value (add or override).
_FLAG_WITH_VALUE = re.compile(r"^(?P<dashes>-{0,2}|\+{1,2})(?P<name>[A-Za-z_][\w.-]*)=(?P<value>.*)$", re.DOTALL)
# The bytes of a record that may hold URL userinfo: a superset of what _URL_USERINFO matches in its text.
_URL_USERINFO_BYTES = re.compile(rb"://[^/\s@]*(?:@[^/\s@]*)*@")
_FLAG = re.compile(r"^--?(?P<name>[A-Za-z_][\w.-]*)$")
_LONG_FLAG = re.compile(r"^--[A-Za-z_][\w.-]*(=.*)?$", re.DOTALL)


def strip_userinfo(text: str) -> str:
    """``text`` with the ``user:password@`` part of every URL in it replaced by ``<redacted>@``."""
    return _URL_USERINFO.sub(REDACTED + "@", text) if "://" in text else text


def check_entry(entry: str) -> None:
    """Raise ValueError for a ``redact`` entry that is empty or a ``re:`` pattern that does not compile."""
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(entry)
    if entry.startswith(PATTERN_PREFIX):
        try:
            re.compile(entry[len(PATTERN_PREFIX):])
        except re.error as exc:
            raise ValueError(f"{entry!r}: {exc}") from None


class Redactor:
    """The rules above, with ``extra`` entries from the ``redact`` setting."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        names, patterns = [], []
        for entry in extra:
            if entry.startswith(PATTERN_PREFIX):
                patterns.append(re.compile(entry[len(PATTERN_PREFIX):]))
            else:
                names.append(_NAME_CHARS.sub("_", entry.strip().upper()))
        self._parts = SECRET_NAME_PARTS + tuple(names)
        self._patterns = tuple(patterns)
        self._any = re.compile("|".join(f"(?:{p.pattern})" for p in patterns)) if patterns else None

    def record(self, line: bytes) -> bytes:
        """A JSONL record (one JSON object and its newline) with :meth:`text` applied to every string in
        it: names, messages, attribute values, error messages, bridged log lines. The one place every
        record passes through (the JSONL processor's write).

        The common record holds nothing to redact and costs one substring test (and, with ``re:``
        patterns, one search of its text); only a record a rule may match is decoded, redacted string by
        string (so no replacement can cross JSON syntax) and encoded again.
        """
        maybe = b"://" in line and _URL_USERINFO_BYTES.search(line) is not None
        if not maybe and self._any is not None:
            maybe = self._any.search(line.decode("utf-8", "replace")) is not None
        if not maybe:
            return line
        try:
            record = _decode(line)
        except Exception:  # noqa: BLE001 - not one JSON value: redact the text whole, as a last resort
            return self.text(line.decode("utf-8", "replace")).encode()
        clean = self._walk(record)
        return line if clean == record else _encode(clean) + b"\n"

    def _walk(self, value: object) -> object:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self._walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v) for v in value]
        return value

    def is_secret_name(self, name: str) -> bool:
        """Whether a variable or flag called ``name`` holds a secret."""
        upper = _NAME_CHARS.sub("_", name.upper())
        return upper.endswith("_HEADERS") or any(part in upper for part in self._parts)

    def text(self, value: str) -> str:
        """``value`` with URL userinfo and every ``re:`` pattern's matches replaced."""
        value = strip_userinfo(value)
        for pattern in self._patterns:
            value = pattern.sub(REDACTED, value)
        return value

    def env(self, env: Mapping[str, str], max_value: int | None = None) -> dict[str, str]:
        """A sorted copy of ``env``: secret names' values redacted, the rest cleaned and cut to ``max_value``."""
        out: dict[str, str] = {}
        for name in sorted(env):
            value = REDACTED if self.is_secret_name(name) else self.text(env[name])
            if max_value is not None and len(value) > max_value:
                value = value[:max_value] + "..."
            out[name] = value
        return out

    def argv(self, argv: Iterable[str]) -> list[str]:
        """A copy of ``argv`` with secret flag values redacted (see module doc)."""
        out: list[str] = []
        value_is_secret = False
        for arg in argv:
            if value_is_secret and not _LONG_FLAG.match(arg):
                out.append(REDACTED)
                value_is_secret = False
                continue
            value_is_secret = False
            with_value = _FLAG_WITH_VALUE.match(arg)
            if with_value is not None and self.is_secret_name(with_value["name"]):
                out.append(f"{with_value['dashes']}{with_value['name']}={REDACTED}")
                continue
            flag = _FLAG.match(arg)
            value_is_secret = flag is not None and self.is_secret_name(flag["name"])
            out.append(self.text(arg))
        return out


class RedactingFilter(logging.Filter):
    """Rewrites log records of libraries that may print endpoints or headers (the OTel SDK's exporters):
    URL userinfo and the given secret values become ``<redacted>``. Attach to the logger that logs."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record: let logging report it as it would
            return True
        clean = strip_userinfo(message)
        for secret in self.secrets:
            if secret and secret in clean:
                clean = clean.replace(secret, REDACTED)
        if clean != message:
            record.msg, record.args = clean, ()
        return True
