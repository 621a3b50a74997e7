"""The server's hash cache: files named after the FNV-1a-64 of their content, as upstream names them.

Unlike upstream, an entry is never served unverified and never left half-written:

* writes go to a hidden temporary file in the same directory, are fsynced, then renamed over the final name, so a
  full disk (or a crash) leaves either the old entry or none, never a truncated one;
* a hit is only ever answered with bytes that hash to the entry's name: the first hit of an entry recomputes the
  file's FNV-1a (a file whose content does not match its name is deleted and answered as a miss, with a log line)
  and remembers the file's identity (device, inode, size, mtime, ctime); later hits read the file straight into the
  tensor and are answered as hits only if that identity is the same before and after the read.  Any write to the
  file, a truncation, a replacement or a ``touch`` changes its ctime, which no unprivileged process can set back,
  so a changed file is verified again (a hit whose file changed during the read is answered as a miss: the client
  then uploads the data, overwriting whatever the read left in the tensor);
* ``max_bytes`` bounds the directory: least recently used entries (saved or served) are evicted first.

The cache is the only state shared between connections of a ``--concurrent`` server, hence the lock.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

import numpy as np
from ggml_rpc.spec import cache_file_name, fnv1a64

log = logging.getLogger("ggml_rpc.reference")

_TEMP_PREFIX = ".tmp-"
# os.write moves at most about 2 GiB per call on Linux; chunks also keep the loop responsive.
_WRITE_CHUNK = 64 << 20
# Indirection so tests can make the disk fill up mid-write without touching os.write for the whole process.
_write = os.write
# File times are taken from a clock that moves in ticks of a few milliseconds (and tests move it).
_now_ns = time.time_ns
#: How long after a file's last change its identity may be trusted (well above the file-time clock's tick).
SETTLED_NS = 200_000_000


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read_full(f: BinaryIO, view: memoryview) -> int:
    """Read into ``view`` until it is full or the file ends; the bytes read."""
    got, size = 0, view.nbytes
    while got < size:
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _is_entry_name(name: str) -> bool:
    """Whether ``name`` is exactly what the spec names some digest's entry (any other file is not ours)."""
    try:
        return cache_file_name(int(name, 16)) == name
    except ValueError:
        return False


class HashCache:
    """A cache directory; thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # Saves under way (payload still arriving or being written): a miss waits for them, briefly, so that a
        # client that uploads on one connection and asks on the next finds its entry on a --concurrent server too.
        self._saving = 0
        self._idle = threading.Condition(self._lock)
        # name -> size, least recently used first.
        self._entries: OrderedDict[str, int] = OrderedDict()
        # name -> identity of the file when its content was last verified (see the module doc string).
        self._verified: dict[str, tuple[int, int, int, int, int]] = {}
        self._scan()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.startswith(_TEMP_PREFIX):
                # Left behind by a process that died mid-write: never a valid entry.
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
            elif _is_entry_name(entry.name) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _mtime, name, size in sorted(found):
            self._entries[name] = size
        self._evict()

    @property
    def total_bytes(self) -> int:
        return sum(self._entries.values())

    def path_for(self, digest: int) -> Path:
        return self.directory / cache_file_name(digest)

    # ---- saves in progress ------------------------------------------------------------------------------------

    def begin_save(self) -> None:
        with self._idle:
            self._saving += 1

    def end_save(self) -> None:
        with self._idle:
            self._saving -= 1
            if not self._saving:
                self._idle.notify_all()

    def wait_for_saves(self, timeout: float) -> bool:
        """Wait until no save is under way (at most ``timeout`` seconds); True if there was one to wait for."""
        with self._idle:
            if not self._saving:
                return False
            self._idle.wait_for(lambda: not self._saving, timeout)
            return True

    # ---- lookup ----------------------------------------------------------------------------------------------

    def entry_size(self, digest: int) -> int | None:
        """Size of the entry named after ``digest``, or None if there is none (nothing is read yet)."""
        try:
            return os.stat(self.path_for(digest)).st_size
        except OSError:
            return None

    def load(self, digest: int, size: int) -> np.ndarray | None:
        """The verified content of an entry of ``size`` bytes, or None (missing, changed size, or corrupt).

        A corrupt entry is deleted.  The caller has already checked that ``size`` bytes fit their destination, so
        nothing is allocated on the strength of a file alone.
        """
        path = self.path_for(digest)
        name = path.name
        out = np.empty(size, dtype=np.uint8)
        try:
            with open(path, "rb", buffering=0) as f:
                before = _identity(os.fstat(f.fileno()))
                got = _read_full(f, memoryview(out))
                extra = f.read(1)
                after = _identity(os.fstat(f.fileno()))
        except OSError as exc:
            log.warning("cache: cannot read entry %s (%s): answered as a miss", name, exc)
            return None
        if got != size or extra:
            log.warning("cache: entry %s changed size while being read: answered as a miss", name)
            return None
        actual = fnv1a64(out)
        if actual != digest:
            log.warning("cache: entry %s is corrupt (content hashes to %s): deleted, answered as a miss", name,
                        cache_file_name(actual))
            self._remove(name)
            return None
        with self._lock:
            # Trusted only if what was hashed is what the file held throughout, and its last change lies well
            # behind: file times come from a coarse clock, so a change in the same tick as the last one could
            # leave ctime as it was; one after this point in time cannot.
            if before == after and _now_ns() - after[4] >= SETTLED_NS:
                self._verified[name] = after
            self._used(name, size)
        # The file's times are left alone (no utime): they are part of the identity a later hit checks.  Recency
        # lives in memory; a restarted server orders entries by the time they were saved.
        return out

    def load_into(self, digest: int, region: memoryview) -> bool:
        """Fill ``region`` with the verified content of the entry of ``region.nbytes`` bytes; False on a miss.

        An entry verified before whose file is unchanged is read straight into ``region``; otherwise it is read,
        verified and copied as :meth:`load` does (so a corrupt or missing entry leaves ``region`` untouched).
        """
        path = self.path_for(digest)
        name = path.name
        size = region.nbytes
        known = self._verified.get(name)
        if known is not None and known[2] == size:
            try:
                with open(path, "rb", buffering=0) as f:
                    if _identity(os.fstat(f.fileno())) == known:
                        got = _read_full(f, region)
                        if got == size and not f.read(1) and _identity(os.fstat(f.fileno())) == known:
                            with self._lock:
                                self._used(name, size)
                            return True
                        log.warning("cache: entry %s changed while being read: answered as a miss", name)
                        self._forget(name)
                        return False
            except OSError as exc:
                log.warning("cache: cannot read entry %s (%s): answered as a miss", name, exc)
                self._forget(name)
                return False
            self._forget(name)  # changed since it was verified: verify it again
        data = self.load(digest, size)
        if data is None:
            return False
        region[:] = memoryview(data)
        return True

    def _forget(self, name: str) -> None:
        with self._lock:
            self._verified.pop(name, None)

    def _used(self, name: str, size: int) -> None:
        """``name`` was just served (lock held): most recently used."""
        if name in self._entries:
            self._entries.move_to_end(name)
        else:
            self._entries[name] = size

    # ---- save ------------------------------------------------------------------------------------------------

    def save(self, data: memoryview | bytes | np.ndarray) -> int | None:
        """Store ``data`` under its FNV-1a-64 name atomically; returns the digest, or None if it was not saved."""
        view = memoryview(data).cast("B")
        size = view.nbytes
        digest = fnv1a64(view)
        name = cache_file_name(digest)
        if self.max_bytes is not None and size > self.max_bytes:
            log.info("cache: %d-byte payload %s is larger than the cache limit (%d): not saved", size, name,
                     self.max_bytes)
            return None
        final = self.directory / name
        if self._entries.get(name) == size and self._same_size_on_disk(final, size):
            # Same name, same size: the same content (a damaged copy is caught and dropped when it is next read).
            # Upstream rewrites it on every v6 upload, which makes large uploads several times slower.
            with self._lock:
                if name in self._entries:
                    self._entries.move_to_end(name)
            return digest
        temp = self.directory / f"{_TEMP_PREFIX}{name}-{secrets.token_hex(4)}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                pos = 0
                while pos < size:
                    pos += _write(fd, view[pos : pos + _WRITE_CHUNK])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, final)
        except OSError as exc:
            log.warning("cache: could not save %s (%s): no entry written", name, exc.strerror or exc)
            try:
                os.unlink(temp)
            except OSError:
                pass
            return None
        self._fsync_dir()
        with self._lock:
            self._entries[name] = size
            self._entries.move_to_end(name)
            self._evict(keep=name)
        return digest

    @staticmethod
    def _same_size_on_disk(path: Path, size: int) -> bool:
        try:
            return os.stat(path).st_size == size
        except OSError:
            return False

    def _fsync_dir(self) -> None:
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    # ---- eviction --------------------------------------------------------------------------------------------

    def _remove(self, name: str) -> None:
        try:
            os.unlink(self.directory / name)
        except OSError:
            pass
        with self._lock:
            self._entries.pop(name, None)
            self._verified.pop(name, None)

    def _evict(self, keep: str | None = None) -> None:
        """Drop least recently used entries until the directory fits ``max_bytes`` (lock held or at start)."""
        if self.max_bytes is None:
            return
        total = sum(self._entries.values())
        for name in list(self._entries):
            if total <= self.max_bytes:
                break
            if name == keep:
                continue
            size = self._entries.pop(name)
            self._verified.pop(name, None)
            total -= size
            try:
                os.unlink(self.directory / name)
            except OSError:
                pass
            log.info("cache: evicted %s (%d bytes, least recently used)", name, size)
