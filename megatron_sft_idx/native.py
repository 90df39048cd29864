"""ctypes binding of the native C++ reader/validator (``csrc/``), an independent
implementation of ``docs/FORMAT.md``.

``pip install`` builds the library when a C++ compiler (and zlib's headers) are present and
ships it next to this module, in ``_native/``, with the ``sft_idx_check`` executable; without a
compiler the install still succeeds, ``_native/NOT_BUILT`` says why, and the Python reader and
gate (the reference) do everything. Nothing is compiled at import time::

    from megatron_sft_idx.native import NativeShard, available, validate
    shard = NativeShard("/data/train_000")     # or NativeShard(prefix, lib_path=...)
    input_ids, loss_mask, seq_start_id = shard.pack(17)
    report = validate("/data/train_000")       # report.passed, report.findings

Which library: ``lib_path`` when given; else ``$MEGATRON_SFT_IDX_NATIVE_LIB`` (e.g. one built by
``bash csrc/build.sh``, which puts ``sft_idx_check`` beside it); else the one the install built.
``MEGATRON_SFT_IDX_NATIVE=0`` disables the last two (and skips the build at install time).

Loading fails with :class:`NativeLibraryError` (an ``ImportError``), so callers
can fall back to the pure-Python reader. A shard the native code refuses raises
the project's :class:`~megatron_sft_idx.errors.ShardError` subclass for the
finding code it reports. ctypes releases the GIL for every native call.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .errors import (
    DTypeError,
    HeaderError,
    IncompleteShardError,
    InvariantError,
    MetadataError,
    MetadataLimitError,
    ShardError,
    ShardNotFoundError,
    SizeMismatchError,
    TruncatedFileError,
    VersionError,
)
from .format import INT32_MAX
from .jsondoc import parse_json

ENV_VAR = "MEGATRON_SFT_IDX_NATIVE_LIB"
ENABLE_VAR = "MEGATRON_SFT_IDX_NATIVE"
ABI_VERSION = 1
VERDICTS = ("pass", "fail", "unreadable")
# What the install builds (setup.py runs csrc/build.sh into this directory), or the reason it did not.
BUNDLED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native")
LIBRARY_NAME = "libsft_idx.so"
CHECKER_NAME = "sft_idx_check"
NOT_BUILT_NAME = "NOT_BUILT"
_REBUILD = ("install g++ and zlib's headers (apt-get install g++ zlib1g-dev) and reinstall megatron_sft_idx, "
            "or build it with `bash csrc/build.sh DIR` and set MEGATRON_SFT_IDX_NATIVE_LIB=DIR/libsft_idx.so")


class NativeLibraryError(ImportError):
    """The native library is disabled, not built, missing, or of another ABI version."""


def _bundled(name: str) -> str:
    """``name`` in the directory the install built into, or why it is not there."""
    path = os.path.join(BUNDLED_DIR, name)
    if os.path.isfile(path):
        return path
    try:
        with open(os.path.join(BUNDLED_DIR, NOT_BUILT_NAME), encoding="utf-8") as f:
            reason = f.readline().strip()
    except OSError:
        reason = "no native build found next to the package"
    raise NativeLibraryError(f"the native reader/validator was not built when megatron_sft_idx was installed "
                             f"({reason}); {_REBUILD}; the Python reader and check-idx do not need it")


def _enabled() -> None:
    if os.environ.get(ENABLE_VAR, "1").strip() == "0":
        raise NativeLibraryError(f"the native library is disabled by {ENABLE_VAR}=0")


def library_path() -> str:
    """The native library to load: ``$MEGATRON_SFT_IDX_NATIVE_LIB``, else the one built at install.

    Raises:
        NativeLibraryError: disabled by ``MEGATRON_SFT_IDX_NATIVE=0``, or nothing was built.
    """
    _enabled()
    return os.environ.get(ENV_VAR) or _bundled(LIBRARY_NAME)


def checker_path() -> str:
    """The ``sft_idx_check`` executable: beside ``$MEGATRON_SFT_IDX_NATIVE_LIB``, else the one built at install.

    Raises:
        NativeLibraryError: disabled, not built, or missing beside the configured library.
    """
    _enabled()
    configured = os.environ.get(ENV_VAR)
    if not configured:
        return _bundled(CHECKER_NAME)
    path = os.path.join(os.path.dirname(os.path.abspath(configured)), CHECKER_NAME)
    if not os.access(path, os.X_OK):
        raise NativeLibraryError(f"no executable {CHECKER_NAME} beside {ENV_VAR}={configured} "
                                 f"(csrc/build.sh writes both into one directory)")
    return path


def available() -> bool:
    """True when :func:`load_library` with no argument would succeed."""
    try:
        load_library()
    except NativeLibraryError:
        return False
    return True


class _Error(ctypes.Structure):
    _fields_ = [("code", ctypes.c_char * 48), ("file", ctypes.c_char * 1024), ("message", ctypes.c_char * 1024),
                ("pack", ctypes.c_int64)]


class _Pack(ctypes.Structure):
    _fields_ = [("input_ids", ctypes.c_void_p), ("loss_mask", ctypes.c_void_p), ("seq_start_id", ctypes.c_void_p),
                ("packed_len", ctypes.c_uint64), ("num_seqs", ctypes.c_uint64),
                ("token_dtype_code", ctypes.c_int32), ("reserved", ctypes.c_int32)]


class _Finding(ctypes.Structure):
    _fields_ = [("code", ctypes.c_char_p), ("severity", ctypes.c_char_p), ("file", ctypes.c_char_p),
                ("message", ctypes.c_char_p), ("rule", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("pack", ctypes.c_int64), ("offset", ctypes.c_int64)]


_SIGNATURES = {
    "sft_idx_abi_version": (ctypes.c_int, []),
    "sft_idx_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_Error)]),
    "sft_idx_close": (None, [ctypes.c_void_p]),
    "sft_idx_size": (ctypes.c_uint64, [ctypes.c_void_p]),
    "sft_idx_sequence_count": (ctypes.c_uint64, [ctypes.c_void_p]),
    "sft_idx_token_count": (ctypes.c_uint64, [ctypes.c_void_p]),
    "sft_idx_token_dtype": (ctypes.c_int32, [ctypes.c_void_p]),
    "sft_idx_pack_size": (ctypes.c_int64, [ctypes.c_void_p]),
    "sft_idx_vocab_size": (ctypes.c_int64, [ctypes.c_void_p]),
    "sft_idx_pad_seq_to_mult": (ctypes.c_int64, [ctypes.c_void_p]),
    "sft_idx_metadata_json": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                             ctypes.POINTER(ctypes.c_uint64)]),
    "sft_idx_get_pack": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(_Pack),
                                        ctypes.POINTER(_Error)]),
    "sft_idx_check_pack": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64,
                                          ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(_Error)]),
    "sft_idx_validate": (ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64]),
    "sft_idx_report_verdict": (ctypes.c_int, [ctypes.c_void_p]),
    "sft_idx_report_count": (ctypes.c_uint64, [ctypes.c_void_p]),
    "sft_idx_report_total": (ctypes.c_uint64, [ctypes.c_void_p]),
    "sft_idx_report_errors": (ctypes.c_uint64, [ctypes.c_void_p]),
    "sft_idx_report_finding": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(_Finding)]),
    "sft_idx_report_free": (None, [ctypes.c_void_p]),
}

_LIBS: Dict[str, ctypes.CDLL] = {}
_LOCK = threading.Lock()


def load_library(lib_path: Optional[str] = None) -> ctypes.CDLL:
    """The native library at ``lib_path`` (default: :func:`library_path`), loaded once per path.

    Raises:
        NativeLibraryError: none is configured or built, the file cannot be loaded, or its ABI differs.
    """
    path = os.path.abspath(os.fspath(lib_path if lib_path is not None else library_path()))
    with _LOCK:
        lib = _LIBS.get(path)
        if lib is not None:
            return lib
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise NativeLibraryError(f"cannot load the native library {path}: {exc}; {_REBUILD}") from None
        try:
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        except AttributeError as exc:
            raise NativeLibraryError(f"{path} is not the megatron_sft_idx native library: {exc}") from None
        version = lib.sft_idx_abi_version()
        if version != ABI_VERSION:
            raise NativeLibraryError(f"{path} has ABI version {version}; this binding needs {ABI_VERSION}: "
                                     f"rebuild it ({_REBUILD})")
        _LIBS[path] = lib
        return lib


# Finding codes -> the exception class a refusal raises (most specific first).
_ERROR_CLASSES: Tuple[Tuple[Tuple[str, ...], type], ...] = (
    (("SHARD_NOT_FOUND",), ShardNotFoundError),
    (("FILE_MISSING",), IncompleteShardError),
    (("_TRUNCATED",), TruncatedFileError),
    (("_SIZE_MISMATCH", "PACK_COUNT_MISMATCH"), SizeMismatchError),
    (("_BAD_VERSION",), VersionError),
    (("_BAD_DTYPE", "DTYPE_MISMATCH"), DTypeError),
    (("METADATA_LIMIT",), MetadataLimitError),
    (("METADATA_",), MetadataError),
    (("IDX_",), HeaderError),
    (("PACK_OUT_OF_BOUNDS",), InvariantError),
)


def _raise(err: _Error):
    """Raise the ShardError subclass for a native refusal; ``.code`` holds the native finding code."""
    code = err.code.decode("utf-8", "replace")
    message = f"{err.message.decode('utf-8', 'replace')} [{code}]"
    path = os.fsdecode(err.file) or None
    pack = err.pack if err.pack >= 0 else None
    if code == "INDEX_OUT_OF_RANGE":
        raise IndexError(f"{path}: {message}")
    cls = ShardError
    for needles, candidate in _ERROR_CLASSES:
        if any(n in code for n in needles):
            cls = candidate
            break
    exc = cls(message, path=path, pack=pack)
    exc.code = code
    raise exc


class NativeFinding(NamedTuple):
    """One finding of the native validator; the first three fields are (code, pack, message)."""

    code: str
    pack: Optional[int]
    message: str
    severity: str
    rule: int          # 1..13 for a pack invariant (format.Rule), else 0
    file: str
    offset: Optional[int]


class NativeReport(NamedTuple):
    prefix: str
    verdict: str                 # "pass", "fail" or "unreadable"
    findings: List[NativeFinding]
    total_findings: int          # including those beyond max_findings
    errors: int

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def exit_code(self) -> int:
        return VERDICTS.index(self.verdict)


def validate(prefix, checksums: bool = True, vocab_size: Optional[int] = None, max_findings: int = 200,
             lib_path: Optional[str] = None) -> NativeReport:
    """Run the native validator on one shard (every check of docs/FORMAT.md).

    Raises:
        NativeLibraryError: the library cannot be loaded.
        ValueError: ``vocab_size`` or ``max_findings`` is not positive.
    """
    if vocab_size is not None and not 1 <= int(vocab_size) <= INT32_MAX or not 1 <= int(max_findings) <= INT32_MAX:
        raise ValueError(f"vocab_size and max_findings must be in 1..{INT32_MAX}")
    lib = load_library(lib_path)
    prefix = os.fspath(prefix)
    handle = lib.sft_idx_validate(os.fsencode(prefix), int(bool(checksums)), int(vocab_size or 0),
                                  int(max_findings))
    if not handle:
        raise MemoryError("the native validator could not allocate its report")
    try:
        findings = []
        f = _Finding()
        for k in range(lib.sft_idx_report_count(handle)):
            if lib.sft_idx_report_finding(handle, k, ctypes.byref(f)) != 0:
                continue
            findings.append(NativeFinding(
                code=f.code.decode(), pack=f.pack if f.pack >= 0 else None,
                message=f.message.decode("utf-8", "replace"), severity=f.severity.decode(), rule=int(f.rule),
                file=os.fsdecode(f.file), offset=f.offset if f.offset >= 0 else None))
        return NativeReport(prefix=prefix, verdict=VERDICTS[lib.sft_idx_report_verdict(handle)], findings=findings,
                            total_findings=int(lib.sft_idx_report_total(handle)),
                            errors=int(lib.sft_idx_report_errors(handle)))
    finally:
        lib.sft_idx_report_free(handle)


_CTYPES = {8: (ctypes.c_uint16, np.uint16), 4: (ctypes.c_int32, np.int32)}


def _copy(address: int, ctype, count: int, dtype) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)
    view = np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctype)), shape=(count,))
    return np.array(view, dtype=dtype, copy=True)


class NativeShard:
    """A shard opened by the native reader; packs come back as numpy copies.

    Raises (at construction): NativeLibraryError, or the ShardError subclass of
    the first problem the native open() found (missing file, bad header, size...).
    """

    def __init__(self, prefix, lib_path: Optional[str] = None) -> None:
        self._lib = load_library(lib_path)
        self._lib_path = lib_path
        self.prefix = os.fspath(prefix)
        self._handle = None
        handle = ctypes.c_void_p()
        err = _Error()
        if self._lib.sft_idx_open(os.fsencode(self.prefix), ctypes.byref(handle), ctypes.byref(err)) != 0:
            _raise(err)
        self._handle = handle.value
        self._n = int(self._lib.sft_idx_size(self._handle))
        self.token_dtype_code = int(self._lib.sft_idx_token_dtype(self._handle))
        self._ctype, self.dtype = _CTYPES[self.token_dtype_code]

    def _live(self):
        if self._handle is None:
            raise ValueError(f"NativeShard({self.prefix!r}) is closed")
        return self._handle

    def __len__(self) -> int:
        return self._n

    def pack(self, i: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(input_ids, loss_mask, seq_start_id)`` of pack ``i`` (negative counts from the end), copied.

        Raises:
            IndexError: ``i`` is out of range.
            InvariantError: the pack's pointer, length or CSR offsets are corrupt.
        """
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"pack index {i} out of range for {self._n} packs in {self.prefix}")
        out, err = _Pack(), _Error()
        if self._lib.sft_idx_get_pack(self._live(), i, ctypes.byref(out), ctypes.byref(err)) != 0:
            _raise(err)
        n = int(out.packed_len)
        return (_copy(out.input_ids, self._ctype, n, self.dtype),
                _copy(out.loss_mask, ctypes.c_uint8, n, np.uint8),
                _copy(out.seq_start_id, ctypes.c_int32, int(out.num_seqs), np.int32))

    def check_pack(self, i: int, vocab_size: Optional[int] = None) -> Tuple[int, int]:
        """``(rule, position)`` of the first invariant pack ``i`` breaks; ``(0, -1)`` when none."""
        position, err = ctypes.c_int64(-1), _Error()
        rule = self._lib.sft_idx_check_pack(self._live(), int(i), int(vocab_size or 0), ctypes.byref(position),
                                            ctypes.byref(err))
        if rule < 0:
            _raise(err)
        return rule, int(position.value)

    @property
    def metadata(self) -> dict:
        """The metadata JSON as a dict."""
        data, size = ctypes.c_void_p(), ctypes.c_uint64()
        self._lib.sft_idx_metadata_json(self._live(), ctypes.byref(data), ctypes.byref(size))
        return parse_json(ctypes.string_at(data.value, size.value)) if size.value else {}

    @property
    def pack_size(self) -> Optional[int]:
        v = int(self._lib.sft_idx_pack_size(self._live()))
        return None if v < 0 else v

    @property
    def vocab_size(self) -> Optional[int]:
        v = int(self._lib.sft_idx_vocab_size(self._live()))
        return None if v < 0 else v

    def validate(self, checksums: bool = True) -> List[Tuple[str, Optional[int], str]]:
        """Every error and warning of the native validator as ``(code, pack, message)``."""
        report = validate(self.prefix, checksums=checksums, lib_path=self._lib_path)
        return [(f.code, f.pack, f.message) for f in report.findings if f.severity != "info"]

    def close(self) -> None:
        if self._handle is not None:
            self._lib.sft_idx_close(self._handle)
            self._handle = None

    def __enter__(self) -> "NativeShard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def __repr__(self) -> str:
        return f"NativeShard({self.prefix!r}, packs={self._n}, dtype={np.dtype(self.dtype).name})"


__all__ = ["NativeShard", "NativeReport", "NativeFinding", "NativeLibraryError", "validate", "load_library",
           "library_path", "checker_path", "available", "ENV_VAR", "ENABLE_VAR"]
