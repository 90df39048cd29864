"""A lock in object storage: one small object created by a conditional write, held by a lease.

No lock file can keep two runs on two machines from writing one prefix of a bucket; the
store's conditional writes can. The lock is the object ``URL`` (``.../lock``), a JSON body::

    {"host": "node-3", "pid": 4242, "nonce": "9f2c...", "expires": 1764300000.0, "what": "..."}

* **the store**: a lock is only as good as the store's conditional writes. The first lock of a
  bucket in a process probes them (a create-only PUT of a probe object beside the lock, a second
  one that must be refused, a PUT pinned to a wrong ETag that must be refused); a store that
  ignores them is refused by name before the lock is trusted.
* **acquire**: ``PUT`` with ``If-None-Match: *`` (create only). If an object is there, it is read:
  a live lease (``expires`` still ahead, or the holder a live process of this host) refuses the
  run, naming its holder; an expired one (or a dead process of this host) is taken over by a
  ``PUT`` with ``If-Match`` on the ETag read, so of two runs taking it over only one succeeds.
* **heartbeat**: while held, a thread renews the lease every third of
  ``StorageConfig.lease_seconds`` with ``If-Match`` on the ETag of its last write; a renewal
  refused means another run took the lock over (this one stalled past its lease): :meth:`check`
  then raises, and the holder stops before writing more.
* **release**: the heartbeat stops and the object is deleted if it is still this holder's.

A killed holder's lease runs out after ``lease_seconds`` (``MEGATRON_SFT_IDX_LEASE_SECONDS``,
default 60 s) and ``--resume`` takes it over then (at once on the same host). The expiry is
the holder's wall clock: the machines of one cluster are assumed to agree within a lease.
Nothing here knows a dataset.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Optional

from .._atomic import _alive
from ..errors import PreconditionError, ShardError
from ..jsondoc import Doc, parse_json
from ._deadline import Deadline
from .config import StorageConfig
from .urls import ObjectURL

log = logging.getLogger("megatron_sft_idx.storage")

#: The largest lock object read back (a lock is ~200 bytes).
_MAX_LOCK_BYTES = 64 << 10


class ObjectLock:
    """The lock ``url`` (see the module doc); ``what`` names what it guards in messages.

    Raises:
        ShardError: (made) the lease is below its floor (:meth:`.StorageConfig.lease_floor`);
            (:meth:`acquire`) another live holder has it (its host and pid named), or the store
            ignores conditional writes (its endpoint named).
    """

    def __init__(self, url: str, what: str, config: Optional[StorageConfig] = None) -> None:
        from ._stores import store_for   # (start-up: a local run imports this module, never the clients')

        self.url = ObjectURL.parse(url)
        self.what = what
        self.config = StorageConfig.resolve(config)
        self.config.check_lease()
        self.store = store_for(self.url, self.config)
        self.nonce = uuid.uuid4().hex
        self.etag = ""
        self.held = False
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._mutex = threading.Lock()

    # ------------------------------------------------------------------ the object

    def _body(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "nonce": self.nonce,
                           "expires": time.time() + self.config.lease_seconds, "what": self.what},
                          sort_keys=True).encode()

    def read(self):
        """``(holder, etag)`` of the lock object now, or ``(None, "")`` when there is none.
        ``holder``: its parsed body (``host``, ``pid``, ``nonce``, ``expires``).

        Raises:
            MetadataError: the object is not a lock (naming the URL and the field)."""
        info = self.store.head(self.url)
        if info is None:
            return None, ""
        if info.size > _MAX_LOCK_BYTES:
            raise ShardError("not a lock object (too large)", path=str(self.url), expected=f"<= {_MAX_LOCK_BYTES}",
                             actual=info.size, hint="remove the object if no run is using it")
        try:
            data = bytes(self.store.read_range(self.url, 0, info.size, info.etag))
        except ShardError as exc:
            if type(exc).__name__ in ("ShardNotFoundError", "ObjectChangedError"):
                return self.read()   # released or renewed between the HEAD and the GET
            raise
        doc = Doc(parse_json(data, str(self.url)), str(self.url))
        holder = {"host": doc.str("host"), "pid": doc.int("pid", lo=0), "nonce": doc.str("nonce"),
                  "expires": doc.number("expires", 0.0, 1e12)}
        return holder, info.etag

    def owner(self) -> Optional[dict]:
        """The holder now (see :meth:`read`), or None."""
        return self.read()[0]

    def holder(self) -> Optional[str]:
        """The live holder other than this one, described (``pid 42 on node-3``), or None."""
        holder = self.owner()
        if holder is None or holder["nonce"] == self.nonce or not self.live(holder):
            return None
        return self.describe(holder)

    @staticmethod
    def describe(holder: dict) -> str:
        return f"pid {holder['pid']} on {holder['host']}"

    def live(self, holder: dict) -> bool:
        """Whether ``holder``'s lease still runs (a dead process of this host holds none)."""
        if holder["host"] == socket.gethostname() and not _alive(holder["pid"]):
            return False   # a dead process of this host: its lease is over now
        return holder["expires"] > time.time()

    # ------------------------------------------------------------------ acquire, renew, release

    def acquire(self) -> None:
        """Create the lock, or take over an expired one (see the module doc); start the heartbeat.
        The first lock of a bucket in this process proves the store honours conditional writes
        (:func:`require_conditional_writes`)."""
        require_conditional_writes(self.store, self.url)
        for _ in range(4):
            try:
                self.etag = self.store.put_bytes(self.url, self._body(), create_only=True)
                break
            except PreconditionError:
                pass
            holder, etag = self.read()
            if holder is None:
                continue   # released meanwhile: create it again
            if holder["nonce"] == self.nonce:   # our own PUT landed, its answer was lost
                self.etag = etag
                break
            if self.live(holder):
                raise ShardError(f"another process ({self.describe(holder)}) is writing {self.what}",
                                 path=str(self.url), field="lock",
                                 hint=f"wait for it to finish, or stop it; a lock whose holder stopped renewing "
                                      f"it is taken over {self.config.lease_seconds:g} s after its last renewal "
                                      "(MEGATRON_SFT_IDX_LEASE_SECONDS)")
            try:
                self.etag = self.store.put_bytes(self.url, self._body(), if_match=etag)
                log.info("took over the expired lock %s of %s", self.url, self.describe(holder))
                break
            except PreconditionError:
                continue   # another run took it over first: read it again
        else:
            raise ShardError(f"cannot take the lock of {self.what}: it keeps changing", path=str(self.url),
                             field="lock", hint="another run is starting on it; wait and rerun")
        self.held = True
        self.lost = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="msi-lease", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        period = self.config.lease_seconds / 3
        while not self._stop.wait(period):
            with self._mutex:
                if not self.held:
                    return
                try:   # (within the lease left: a renewal that cannot land in time is no renewal)
                    self.etag = self.store.put_bytes(self.url, self._body(), if_match=self.etag,
                                                     deadline=Deadline(2 * period))
                except PreconditionError:
                    self.lost = "another run took the lock over (this run did not renew it in time)"
                    log.error("lost the lock %s: %s", self.url, self.lost)
                    return
                except ShardError as exc:   # a failed renewal: try again at the next beat
                    log.warning("could not renew the lock %s: %s", self.url, exc)

    def check(self) -> None:
        """Raises ShardError when the lease was lost (another run holds the lock now)."""
        if self.lost:
            raise ShardError(f"lost the lock of {self.what}: {self.lost}", path=str(self.url), field="lock",
                             hint="two runs wrote the same place; rerun one of them with --resume")

    def release(self) -> None:
        """Stop renewing; delete the object if it is still this holder's."""
        with self._mutex:
            if not self.held:
                return
            self.held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            holder, _ = self.read()
            if holder is not None and holder["nonce"] == self.nonce:
                self.store.delete(self.url)
        except ShardError as exc:   # its lease runs out by itself
            log.warning("could not release the lock %s: %s", self.url, exc)


#: ``{store: {bucket: '' (honours conditional writes) or what it ignores}}``: probed once per
#: bucket of each store client of this process (a new client, after the endpoint changed, probes again)
_PROBED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PROBE_LOCK = threading.Lock()
#: The prefix of a probe object's name beside the lock (never mirrored: storage/mirror.py)
PROBE_SUFFIX = ".probe-"


def require_conditional_writes(store, url: ObjectURL) -> None:
    """Prove, once per bucket of ``store`` (an endpoint's client), that the server honours
    conditional writes before a lock at ``url`` is trusted: a create-only PUT (``If-None-Match:
    *``) of a new probe object ``url`` + ``.probe-<nonce>`` succeeds, a second one is refused
    (412), and a PUT with ``If-Match`` on an ETag the object does not have is refused; the probe is
    deleted. Stores that ignore the headers (older MinIO and Ceph RGW, several gateways, S3
    before 2024-08) would let two runs hold one lock.

    Raises:
        ShardError: the server ignores a condition (naming the endpoint and which), or
            (``msc://``) offers none.
    """
    with _PROBE_LOCK:
        known = _PROBED.setdefault(store, {}).get(url.bucket)
        if known is None:
            known = _PROBED[store][url.bucket] = _probe(store, url)
    if known:
        raise ShardError(f"the object store at {store.endpoint(url)} {known}: a lock there cannot keep two runs "
                         "from writing one place", path=str(url), field="precondition",
                         hint="use a store that honours If-None-Match and If-Match on PUT (AWS S3 since "
                              "2024-08, recent MinIO and Ceph RGW), or keep the store and work directory on "
                              "a shared filesystem")


def _probe(store, url: ObjectURL) -> str:
    """'' when conditional PUTs hold at ``url``'s bucket, else what the server ignored."""
    probe = url.with_suffix(f"{PROBE_SUFFIX}{uuid.uuid4().hex[:12]}")
    try:
        try:
            store.put_bytes(probe, b"probe", create_only=True)
        except PreconditionError:
            pass   # (an attempt of ours landed before its retry: the probe exists)
        try:
            store.put_bytes(probe, b"probe again", create_only=True)
            return "ignores If-None-Match: * (a create-only PUT replaced an existing object)"
        except PreconditionError:
            pass
        try:
            store.put_bytes(probe, b"probe again", if_match='"' + "0" * 32 + '"')
            return "ignores If-Match (a PUT pinned to another ETag replaced the object)"
        except PreconditionError:
            return ""
    finally:
        try:
            store.delete(probe)
        except ShardError:
            pass   # (a leftover probe holds nothing; the lock's own errors follow)


__all__ = ["ObjectLock", "require_conditional_writes"]
