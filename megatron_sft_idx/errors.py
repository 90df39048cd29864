"""One exception tree for everything the project refuses.

Every error raised for bad input or a bad shard derives from :class:`ShardError`
(itself a ``ValueError``, so callers that already catch ``ValueError`` keep
working). Each carries structured context — ``path``, ``field``, ``pack``,
``expected``, ``actual``, ``hint`` — and renders it into one message that names
the file, the place and the rule, and says what to do::

    ShardError: /data/a.seq.idx: header field 'version_major' is 7, expected one of (1)
    [field=version_major] -- this shard was written by a newer megatron_sft_idx; upgrade it.

Subclasses say *which kind* of problem it is, so a caller can tell a truncated
file from a malformed header without parsing strings.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "ShardError",
    "ShardNotFoundError",
    "ShardExistsError",
    "IncompleteShardError",
    "ShardChangedError",
    "SizeMismatchError",
    "TruncatedFileError",
    "HeaderError",
    "VersionError",
    "DTypeError",
    "MetadataError",
    "MetadataLimitError",
    "ChecksumError",
    "InvariantError",
    "BuilderStateError",
    "InputError",
    "IncompatibleShardsError",
    "ShardSetError",
    "FormatError",
    "MixtureFileError",
    "InfeasibleMixtureError",
    "QueryError",
    "RemoteStorageError",
    "ObjectChangedError",
    "PreconditionError",
    "RemoteTimeoutError",
    "ResponseMismatchError",
    "OutputError",
    "IncompleteDestinationError",
]


class ShardError(ValueError):
    """Base class of every error this project raises for bad input or a bad shard."""

    default_hint: Optional[str] = None

    def __init__(
        self,
        message: str,
        *,
        path: Optional[str] = None,
        field: Optional[str] = None,
        pack: Optional[int] = None,
        expected: Any = None,
        actual: Any = None,
        rule: Optional[str] = None,
        hint: Optional[str] = None,
    ) -> None:
        self.message = message
        self.path = None if path is None else str(path)
        self.field = field
        self.pack = pack
        self.expected = expected
        self.actual = actual
        self.rule = rule
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(self._render())

    def _render(self) -> str:
        head = f"{self.path}: {self.message}" if self.path else self.message
        context = []
        if self.pack is not None:
            context.append(f"pack={self.pack}")
        if self.field is not None:
            context.append(f"field={self.field}")
        if self.rule is not None:
            context.append(f"rule={self.rule}")
        if self.expected is not None:
            context.append(f"expected={self.expected!r}")
        if self.actual is not None:
            context.append(f"actual={self.actual!r}")
        text = head
        if context:
            text += " [" + ", ".join(context) + "]"
        if self.hint:
            text += " -- " + self.hint
        return text

    def __reduce__(self):  # keep the structured fields across pickling (DataLoader workers)
        kwargs = dict(
            path=self.path, field=self.field, pack=self.pack, expected=self.expected,
            actual=self.actual, rule=self.rule, hint=self.hint,
        )
        # The instance dict carries attributes callers attach (e.g. InputError.reason).
        return (_rebuild, (type(self), self.message, kwargs), dict(self.__dict__))


def _rebuild(cls, message, kwargs):
    return cls(message, **kwargs)


class ShardNotFoundError(ShardError, FileNotFoundError):
    """A file the shard needs does not exist."""

    default_hint = "check the prefix: it is the path without '.idx'/'.bin'"


class ShardExistsError(ShardError, FileExistsError):
    """Writing would replace an existing shard and the caller did not allow it."""

    default_hint = "pass overwrite=True (or --overwrite / --replace) to replace it"


class IncompleteShardError(ShardError):
    """Some of the five files are present and others are not (an interrupted write or copy)."""

    default_hint = (
        "the shard was not fully written or copied; rebuild it or copy all five files "
        "(.bin .idx .loss.bin .seq.idx .seq.bin)"
    )


class ShardChangedError(ShardError):
    """The shard's files were replaced (or removed) while it was being opened, again and again.

    A reader takes the five files of one generation or none: it retries a few times while a
    replacement is under way and raises this when the files keep changing under it.
    """

    default_hint = "another process keeps replacing this shard; open it again once the replacement is done"


class SizeMismatchError(ShardError):
    """A file's size disagrees with what a header or the metadata records."""

    default_hint = "the file was cut short, extended, or swapped in from another shard; rebuild it"


class TruncatedFileError(SizeMismatchError):
    """A file is shorter than its header says it must be."""

    default_hint = "the file was cut short (interrupted copy or full disk); copy or rebuild it"


class HeaderError(ShardError):
    """A fixed header is malformed: wrong magic, an impossible count, a reserved field set."""

    default_hint = "the file is not a megatron_sft_idx shard file or is corrupt; rebuild it"


class VersionError(HeaderError):
    """The file declares a format version this reader does not support."""

    default_hint = "the shard was written by a different megatron_sft_idx; use a matching version"


class DTypeError(HeaderError):
    """A dtype code is unknown, or not allowed where it appears."""


class MetadataError(ShardError):
    """The shard metadata (JSON in ``.seq.idx``) is unparsable, incomplete or contradictory."""


class MetadataLimitError(MetadataError):
    """The metadata exceeds one of the format's limits (docs/FORMAT.md "Limits"): nesting
    depth, or a number no implementation can hold (an integer outside int64, a float that
    overflows to infinity)."""

    default_hint = ("a writer of this format never produces such metadata: the .seq.idx is corrupt "
                    "or was written by another tool; rebuild the shard")


class ChecksumError(ShardError):
    """A file's CRC-32 differs from the one recorded when the shard was written."""

    default_hint = "the file was modified or bit-rotted after it was written; restore or rebuild it"


class InvariantError(ShardError):
    """A pack breaks one of the format's invariants (see :class:`megatron_sft_idx.format.Rule`)."""


class BuilderStateError(ShardError):
    """The builder was used out of order (e.g. ``add_packed`` after ``finalize``)."""


class InputError(ShardError):
    """An input record is unusable: malformed JSON, a missing key, an empty conversation,
    a role the chat template rejects, a token id outside the vocabulary, an overlong
    sequence under ``--overlong error``. ``path`` is ``file:line``; ``reason`` is the
    key under which ``--skip-bad`` counts it."""

    default_hint = "fix or remove the record, or pass --skip-bad to skip and count such records"


class IncompatibleShardsError(ShardError):
    """Shards that cannot be read or merged as one: their tokenizers, chat templates,
    vocabularies, token dtypes (merge only), loss-mask conventions, pad multiples or
    context-parallel layouts differ (``field`` names which; the message says it in words)."""

    default_hint = "merge only shards produced with the same settings, or re-run preprocessing"


class ShardSetError(ShardError):
    """Shards selected together (by a directory, a glob or a manifest) do not form whole
    sets: a set has shards missing or named twice (an interrupted publish or copy), a
    directory or glob holds shards of several sets (two generations of one output, or
    two outputs), or a shard is not the one its manifest lists. ``field`` is ``set``."""

    default_hint = ("rerun the interrupted run with --resume to finish the set, or name one set by "
                    "its manifest")


class FormatError(ShardError):
    """An input is not in the format a tool expected, or in no format it recognises."""


class MixtureFileError(ShardError):
    """A mixture file (``--mix``) that is not one valid document: unparsable, a key unknown or
    given twice, a value out of range. Nothing is published (exit 1)."""

    default_hint = "fix the mixture file (docs/PREPROCESSING.md, \"Mixtures\", states every key)"


class InfeasibleMixtureError(ShardError):
    """A mixture's targets cannot be met under its caps, or a source has nothing to give in a
    split; the message says the largest total the caps allow."""


class QueryError(ShardError):
    """A SQL query over shards failed to parse or run; the message is the engine's."""

    default_hint = "query the table 'packs' (columns: pack, packed_len, num_sequences, trainable_tokens, " \
                   "input_ids, loss_mask, seq_start_id, shard)"


class RemoteStorageError(ShardError):
    """Object storage (``s3://``, ``msc://``) refused or kept failing a request: retries were
    exhausted, access was denied, or a response was malformed. ``path`` names the object."""

    default_hint = ("check the endpoint and credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY, AWS_REGION, or the MSC profile) and that the object exists")


class ObjectChangedError(RemoteStorageError):
    """A remote object was replaced after the shard was opened (its ETag or size changed):
    reading on would mix two generations of the shard."""

    default_hint = "the shard was re-uploaded while it was being read; reopen it"


class PreconditionError(ObjectChangedError):
    """A conditional write to object storage was refused (``412 PreconditionFailed``): an object
    written create-only (``If-None-Match: *``) already exists, or one replaced with ``If-Match``
    is no longer the version read. ``expected`` is the condition."""

    default_hint = "another writer got there first; read the object again before deciding"


class RemoteTimeoutError(RemoteStorageError):
    """A remote request or operation outlived its wall-clock budget: the server stalled, or
    sent its response too slowly (a byte every few seconds defeats a socket read timeout, not
    this). ``field`` is ``request_timeout`` or ``operation_timeout``; ``expected`` the budget."""

    default_hint = ("the store stalls or trickles; check it and the network, or raise "
                    "MEGATRON_SFT_IDX_REQUEST_TIMEOUT / MEGATRON_SFT_IDX_OPERATION_TIMEOUT "
                    "(docs/STORAGE.md)")


class ResponseMismatchError(RemoteStorageError):
    """A response does not answer its request: a ranged GET answered with the whole object
    (``Range`` ignored), another range (``Content-Range``), another length (``Content-Length``),
    or a listing that never ends (a repeated continuation token or key). Refused before its
    body is read; never retried (the same server answers the same way)."""

    default_hint = ("the server or a proxy in front of it does not speak S3 faithfully (ranges, "
                    "listings); read through one that does")


class OutputError(ShardError):
    """Writing an output failed in the filesystem: the disk is full, the filesystem is
    read-only, permission is denied, or a directory of the output cannot be created.
    ``path`` is the file or directory the system refused; ``errno`` the system's code."""

    default_hint = "fix the destination (free space, permissions, a writable filesystem) and rerun"


class IncompleteDestinationError(ShardError):
    """A publication ended, and the destination read back is not what it published: a file of
    the set (a shard's, an order, a manifest) is missing or differs, or an old file the new
    generation does not bring is still there. ``path`` names the first such file."""

    default_hint = "publish again with --overwrite / --replace (the staged output is kept where the run keeps it)"
