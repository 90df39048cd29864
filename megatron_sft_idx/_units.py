"""Sizes and counts as people write and read them: the one size parser, and the summary helpers.

Every command-line flag that takes a byte count reads it with :func:`parse_size` (through
:func:`megatron_sft_idx._cli.size_arg`: ``--max-shard-bytes 1G``,
``--partition-bytes 64M``, ``--max-record-bytes 512KiB``); every summary prints sizes with
:func:`human_bytes` and counts with :func:`plural`. Suffixes follow rsync: ``K``/``M``/``G``/``T``
(optionally with ``iB``) are powers of 1024, ``KB``/``MB``/``GB``/``TB`` powers of 1000; case
does not matter, a fraction is allowed (``1.5G``), ``B`` alone or no suffix is bytes.
"""

from __future__ import annotations

import math
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
#: The largest byte count a flag takes (an exbibyte): past it a size is a typo, not a plan.
MAX_SIZE = 1 << 60
#: The longest duration a flag takes, in seconds (30 days).
MAX_SECONDS = 30 * 86400


def parse_size(text: str) -> int:
    """Bytes in ``text`` (``"65536"``, ``"8M"``, ``"1.5GiB"``, ``"2GB"``).

    Raises:
        ValueError: not a size (the message shows what is accepted).
    """
    m = _SIZE.match(str(text))
    if not m or (m.group(3).lower() == "i" or (m.group(3).lower() == "ib" and not m.group(2))):
        raise ValueError(f"expected a size like 65536, 512K, 64M, 1G or 1.5GiB, got {text!r}")
    number, prefix, tail = m.groups()
    base = 1000 if tail.lower() == "b" and prefix else 1024
    value = float(number) * base ** _POWER[prefix.lower()]
    if not math.isfinite(value) or value > MAX_SIZE:
        raise ValueError(f"expected a size of at most {MAX_SIZE} bytes (1 EiB), got {text!r}")
    return int(round(value))


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; bytes below 1 KiB exactly (``"512 B"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"  # pragma: no cover


def plural(count: int, word: str, many: str = "") -> str:
    """``plural(1, "shard")`` -> ``"1 shard"``, ``plural(2, "shard")`` -> ``"2 shards"``."""
    return f"{count:,} {word if count == 1 else (many or word + 's')}"


def duration(seconds: float) -> str:
    """``75.2`` -> ``"1:15"``, ``3725`` -> ``"1:02:05"``."""
    s = int(max(0.0, seconds) + 0.5)
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"
