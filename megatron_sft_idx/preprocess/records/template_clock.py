"""The template's clock: templates that read it (``strftime_now``, as Meta's Llama 3.1/3.2 templates
print today's date) render a pinned date instead, ``--template-date`` (docs/INPUTS.md, "Templates
that read the clock"), so the bytes depend on neither the time zone nor the day."""

from __future__ import annotations

import datetime
from typing import Optional

from ...errors import ShardError


def reads_clock(template: Optional[str]) -> bool:
    """True when the template can print the time (transformers gives templates ``strftime_now``)."""
    return template is not None and "strftime_now" in template


def utc_today() -> str:
    """Today's date in UTC, ``YYYY-MM-DD`` (the default ``--template-date``)."""
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def check_template_date(value: str) -> str:
    """``value`` if it is a ``YYYY-MM-DD`` date.

    Raises:
        ShardError: it is not.
    """
    try:
        if isinstance(value, str) and len(value) == 10:
            return datetime.date.fromisoformat(value).isoformat()
    except ValueError:
        pass
    raise ShardError(f"--template-date {value!r} is not a date", field="template_date", actual=value,
                     hint="give it as YYYY-MM-DD, e.g. 2024-07-26")


def pinned_clock(date: str):
    """``strftime_now`` for templates, at midnight of ``date`` whatever the time zone or the day."""
    moment = datetime.datetime.combine(datetime.date.fromisoformat(date), datetime.time())

    def strftime_now(fmt: str) -> str:
        return moment.strftime(fmt)
    return strftime_now
