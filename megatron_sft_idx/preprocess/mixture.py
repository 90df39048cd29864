"""The mixture file: sources, their weights and caps, stated once (``--mix FILE``).

One JSON object (``.json``), or one YAML document (``.yaml`` / ``.yml``, when PyYAML is
installed: the ``preprocess`` extra brings it), version 1 (docs/PREPROCESSING.md "Mixtures"
is the specification)::

    {"version": 1, "unit": "trained_tokens", "total": null, "window_steps": 10,
     "sources": [{"name": "chat", "inputs": ["data/chat/*.jsonl"], "store": "stores/chat", "weight": 3},
                 {"name": "reasoning", "store": "s3://bucket/stores/reasoning", "weight": 1,
                  "max_epochs": 2, "max_tokens": 500000000}]}

Parsed as strictly as the project's other artifacts: at most :data:`MAX_MIXTURE_BYTES` of
UTF-8, one document (JSON through :func:`~megatron_sft_idx.jsondoc.parse_json`'s limits; YAML
without anchors or aliases), no key given twice, no key this version does not define, every
value of its type and range. Any violation is one :class:`~megatron_sft_idx.errors.ShardError`
naming the file and the field (``sources[2].weight``). Relative paths (a source's ``store`` and
``inputs``) are relative to the mixture file's directory; URLs are kept as written.

Nothing here reads a store or an input: :mod:`.mixplan` does, once the file is valid.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from ..errors import MixtureFileError, ShardError
from ..jsondoc import Doc, normal_json, parse_json
from ..storage.paths import beside, comparable

MIXTURE_VERSION = 1
#: The units a weight may be stated in (the first is the default).
UNITS = ("trained_tokens", "tokens", "sequences", "epochs")
#: The largest mixture file read (a mixture names sources, not data).
MAX_MIXTURE_BYTES = 1 << 20
#: The most sources one mixture holds (a shard records each sequence's source as a uint16).
MAX_SOURCES = 1024
#: Default K of "every window of K steps" (the report, and the interleaved order's target).
DEFAULT_WINDOW_STEPS = 10
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_TOP_KEYS = ("version", "unit", "total", "window_steps", "sources")
_SOURCE_KEYS = ("name", "store", "inputs", "weight", "max_epochs", "max_tokens")
_YAML_SUFFIXES = (".yaml", ".yml")
_HINT = MixtureFileError.default_hint


@dataclass(frozen=True)
class MixSource:
    """One source of a mixture: a sequence store (``store``: an absolute path or a URL), made
    from ``inputs`` when given (tokenized by ``preprocess-sft --mix``), with its ``weight`` in
    the mixture's unit and optional caps."""

    name: str
    store: str
    weight: float
    inputs: Tuple[str, ...] = ()
    max_epochs: Optional[float] = None
    max_tokens: Optional[int] = None

    def to_dict(self) -> dict:
        """What a plan records of the source (where its inputs are is not what it holds)."""
        return {"name": self.name, "weight": self.weight, "max_epochs": self.max_epochs,
                "max_tokens": self.max_tokens}


@dataclass(frozen=True)
class Mixture:
    """A mixture file, parsed (:func:`load_mixture`). ``total`` is in ``unit`` (None: the largest
    mixture the caps allow: module doc of :mod:`.mixing`); ``window_steps`` is K."""

    path: str
    sources: Tuple[MixSource, ...]
    unit: str = UNITS[0]
    total: Optional[float] = None
    window_steps: int = DEFAULT_WINDOW_STEPS

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.sources]

    @property
    def weights(self) -> List[float]:
        return [s.weight for s in self.sources]

    def to_dict(self) -> dict:
        """What decides the packs (the plan records it, the run key digests it)."""
        return normal_json({"unit": self.unit, "total": self.total, "window_steps": self.window_steps,
                            "sources": [s.to_dict() for s in self.sources]})


def load_mixture(path: str) -> Mixture:
    """The mixture file ``path``, parsed and checked (module doc).

    Raises:
        ShardError: unreadable, not one valid JSON/YAML document, a key given twice or unknown,
            a value of the wrong type or range (a weight <= 0, NaN or infinite, an unknown unit,
            a total with the ``epochs`` unit, two sources of one name or one store), naming the
            file and the field.
    """
    path = os.path.abspath(os.fspath(path))
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MIXTURE_BYTES + 1)
    except OSError as exc:
        raise ShardError(f"cannot read the mixture file ({exc.strerror or exc})", path=path,
                         hint="give --mix the path of a mixture file (JSON or YAML)") from None
    if len(raw) > MAX_MIXTURE_BYTES:
        raise ShardError(f"the mixture file is larger than {MAX_MIXTURE_BYTES} bytes", path=path, field="(file)",
                         hint="a mixture names sources, not data: is this the mixture file?")
    value = _load_yaml(raw, path) if path.lower().endswith(_YAML_SUFFIXES) else _load_json(raw, path)
    return parse_mixture(value, path)


def parse_mixture(value: Any, path: str) -> Mixture:
    """A mixture from the document ``value`` of the file ``path`` (see :func:`load_mixture`).

    Raises:
        ShardError: see :func:`load_mixture`.
    """
    doc = Doc(value, path, error=MixtureFileError)
    _refuse_unknown(doc, _TOP_KEYS)
    version = doc.int("version")
    if version != MIXTURE_VERSION:
        raise doc.fail(f"unsupported mixture version {version}; supported: {MIXTURE_VERSION}", "version",
                       expected=MIXTURE_VERSION, actual=version)
    unit = doc.str("unit", choices=UNITS, default=UNITS[0])
    total = _positive(doc, "total", none=True)
    if total is not None and unit == "epochs":
        raise doc.fail("a total has no meaning when weights are epochs (each source's weight is its epochs)",
                       "total", hint="drop the total, or state the weights in another unit")
    window = doc.int("window_steps", lo=1, hi=1 << 20, default=DEFAULT_WINDOW_STEPS)
    items = doc.list("sources")
    if not 1 <= len(items) <= MAX_SOURCES:
        raise doc.fail(f"a mixture holds 1 to {MAX_SOURCES} sources", "sources", actual=len(items))
    base = os.path.dirname(path)
    sources = tuple(_source(s, base, unit) for s in doc.docs("sources"))
    _refuse_duplicates(doc, sources)
    return Mixture(path=path, sources=sources, unit=unit, total=total, window_steps=window)


def _source(doc: Doc, base: str, unit: str) -> MixSource:
    _refuse_unknown(doc, _SOURCE_KEYS)
    name = doc.str("name", pattern=_NAME)
    store = _location(doc, "store", doc.str("store"), base)
    inputs = doc.list("inputs", default=None)
    if inputs is not None:
        if not inputs:
            raise doc.fail("lists no input (leave the key out for a source that is a store alone)", "inputs")
        for k, item in enumerate(inputs):
            if not isinstance(item, str) or not item:
                raise doc.fail("must be a non-empty path, glob or URL", f"inputs[{k}]", actual=item)
        inputs = tuple(_location(doc, "inputs", item, base) for item in inputs)
    weight = _positive(doc, "weight")
    max_epochs = _positive(doc, "max_epochs", none=True)
    if max_epochs is not None and unit == "epochs":
        raise doc.fail("max_epochs caps a share, but with the epochs unit the weight is the epochs", "max_epochs")
    max_tokens = _positive(doc, "max_tokens", none=True)
    if max_tokens is not None:
        if max_tokens != int(max_tokens) or max_tokens > 1 << 62:
            raise doc.fail("must be a whole number of tokens", "max_tokens", actual=max_tokens)
        max_tokens = int(max_tokens)
    return MixSource(name=name, store=store, weight=weight, inputs=inputs or (), max_epochs=max_epochs,
                     max_tokens=max_tokens)


def _location(doc: Doc, key: str, value: str, base: str) -> str:
    if "\0" in value or not value.strip():
        raise doc.fail("must be a path or a URL", key, actual=value)
    place = comparable(beside(os.path.join(base, ""), os.path.expanduser(value)))
    return place.rstrip("/") or place   # (a URL's trailing "/" names the same prefix)


def _positive(doc: Doc, key: str, none: bool = False) -> Optional[float]:
    """A finite number > 0 (an int is kept as an int: the plan records it as written)."""
    value = doc.raw(key, None) if none else doc.raw(key)
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise doc.fail("must be a finite number > 0", key, expected="> 0", actual=value)
    return value


def _refuse_unknown(doc: Doc, known: Tuple[str, ...]) -> None:
    unknown = sorted(set(doc.obj) - set(known))
    if unknown:
        raise doc.fail(f"unknown key {unknown[0]!r} (this version knows {', '.join(known)})", unknown[0])


def _refuse_duplicates(doc: Doc, sources: Tuple[MixSource, ...]) -> None:
    seen_names, seen_stores = {}, {}
    for k, s in enumerate(sources):
        if s.name in seen_names:
            raise doc.fail(f"source name {s.name!r} is given twice (sources[{seen_names[s.name]}] too)",
                           f"sources[{k}].name", actual=s.name)
        if s.store in seen_stores:
            raise doc.fail(f"two sources name one store {s.store} (sources[{seen_stores[s.store]}] and [{k}]): "
                           "each source is tokenized into its own store", f"sources[{k}].store", actual=s.store)
        seen_names[s.name], seen_stores[s.store] = k, k


# --------------------------------------------------------------------------- the two syntaxes


def _load_json(raw: bytes, path: str) -> Any:
    return parse_json(raw, path, max_length=MAX_MIXTURE_BYTES, what="mixture file", error=MixtureFileError,
                      limit_error=MixtureFileError, hint=_HINT, unique_keys=True)


def _load_yaml(raw: bytes, path: str) -> Any:
    try:
        import yaml   # (start-up: an optional dependency; a JSON mixture needs none)
    except ImportError:
        raise ShardError("a YAML mixture file needs PyYAML", path=path,
                         hint="pip install 'megatron_sft_idx[preprocess]' (or pyyaml), or write the mixture "
                              "as JSON") from None
    try:
        text = raw.decode("utf-8")
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise MixtureFileError("YAML anchors and aliases are not accepted in a mixture file", path=path,
                                    field="(document)")
        value = yaml.load(text, Loader=_strict_loader(yaml))
    except MixtureFileError as exc:
        raise MixtureFileError(exc.message, path=path, field=exc.field) from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MixtureFileError(f"the mixture file is not one valid YAML document ({first})", path=path,
                            field="(document)") from None
    _json_only(value, path, "", 0)
    return value


def _strict_loader(yaml):
    """A SafeLoader that refuses a key given twice (PyYAML keeps the last one silently)."""

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        out = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if key in out:
                raise MixtureFileError(f"key {key!r} is given twice in one mapping (line {key_node.start_mark.line + 1})",
                                    field=str(key))
            out[key] = loader.construct_object(value_node, deep=True)
        return out

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Strict


def _json_only(value: Any, path: str, where: str, depth: int) -> None:
    """Refuse what JSON cannot hold (YAML dates, binary, sets, non-string keys), and nesting
    beyond 16 levels (a mixture file is shallow)."""
    if depth > 16:
        raise MixtureFileError("the mixture file nests deeper than 16 levels", path=path, field=where or "(document)")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise MixtureFileError("keys must be strings", path=path, field=where or "(document)", actual=key)
            _json_only(item, path, f"{where}.{key}" if where else key, depth + 1)
    elif isinstance(value, list):
        for k, item in enumerate(value):
            _json_only(item, path, f"{where}[{k}]", depth + 1)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise MixtureFileError(f"a {type(value).__name__} is not a JSON value (quote it)", path=path,
                            field=where or "(document)")


__all__ = ["Mixture", "MixSource", "load_mixture", "parse_mixture", "UNITS", "MIXTURE_VERSION", "MAX_SOURCES",
           "DEFAULT_WINDOW_STEPS"]
