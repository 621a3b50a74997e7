"""The server's hash cache: files named after the FNV-1a-64 of their content, as upstream names them.

Unlike upstream, an entry is never served unverified and never left half-written:

* writes go to a hidden temporary file in the same directory, are fsynced, then renamed over the final name, so a
  full disk (or a crash) leaves either the old entry or none, never a truncated one;
* a hit is only ever answered with bytes that hash to the entry's name, whatever happens to the file.  No file
  metadata can promise that: a write through a shared memory mapping need not change mtime or ctime, and some
  filesystems keep times in ticks of 1-2 s.  So the check is made on the bytes served, in one of two ways:

  - *verification*: the file is read into memory of the server's own, its FNV-1a-64 must be the entry's name, and
    only then is that copy put into the tensor (a short, long or corrupt file is answered as a miss, the tensor
    left untouched; a corrupt or short one is deleted);
  - *fingerprint*: FNV-1a is slow (about 1 GB/s, one byte at a time), so whenever the server knows bytes whose FNV-1a
    is the name (it verified them, or it saved them itself), it keeps their XXH3-128 under a seed drawn at start.
    A later hit reads the file straight into the tensor and fingerprints *what landed there*, piece by piece as it
    lands (about 10x faster than FNV-1a); equal fingerprints mean the tensor holds the verified bytes (a different
    content matches by chance with probability about 2^-128, far below the 2^-64 at which a different content
    shares the FNV-1a-64 name itself, and the seed is unknown outside the process).  A fingerprint that differs
    sends the entry to verification again.

  The fingerprint path is taken only while the file's identity (device, inode, size, mtime, ctime) is the one it
  had when the fingerprint was taken.  Correctness does not depend on that identity; it only predicts that the file
  still holds the fingerprinted bytes, so that a file that visibly changed (any write, truncation, replacement or
  touch changes ctime) is verified without writing its bytes into the tensor first.  A change that the identity
  does not show is caught by the fingerprint after the read: the hit becomes a verification, and a miss then leaves
  in the tensor what the read put there (the client uploads the data next, overwriting it);
* ``max_bytes`` bounds the directory: least recently used entries (saved or served) are evicted first.

The cache is the only state shared between connections of a ``--concurrent`` server, hence the lock.  A
connection's core never calls what blocks here: it yields effects (:mod:`.effects`) that the I/O module carries out
with :meth:`HashCache.carry_out`, and holds the cache as an :class:`~.effects.EntryCache` (saves announced and over).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash
from ggml_rpc.spec import cache_file_name, fnv1a64

from .effects import Effect, FindEntry, LoadEntry, SaveEntry

log = logging.getLogger("ggml_rpc.reference")

_TEMP_PREFIX = ".tmp-"
# os.write moves at most about 2 GiB per call on Linux; chunks also keep the loop responsive.
_WRITE_CHUNK = 64 << 20
# Indirection so tests can make the disk fill up mid-write without touching os.write for the whole process.
_write = os.write
# Pieces a direct read is fingerprinted in: small enough to be hashed while still in the CPU's cache.
_HASH_CHUNK = 1 << 20

Identity = tuple[int, int, int, int, int]


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _fingerprint(data: memoryview | np.ndarray, seed: int) -> int:
    """XXH3-128 of ``data`` under ``seed``: the cheap stand-in for FNV-1a on bytes already verified once."""
    return xxhash.xxh3_128_intdigest(data, seed)


def _fingerprinter(seed: int) -> xxhash.xxh3_128:
    """A streaming XXH3-128 under ``seed``: fed piece by piece, it gives what :func:`_fingerprint` gives whole."""
    return xxhash.xxh3_128(seed=seed)


def _read_fingerprinting(f: BinaryIO, view: memoryview, seed: int) -> tuple[int, int]:
    """Read into ``view`` until it is full or the file ends, fingerprinting each piece where it landed while it is
    still in the CPU's cache (a second pass over a large tensor would come from memory); (bytes read, fingerprint)."""
    h = _fingerprinter(seed)
    got, size = 0, view.nbytes
    while got < size:
        n = f.readinto(view[got : got + _HASH_CHUNK])
        if not n:
            break
        h.update(view[got : got + n])
        got += n
    return got, h.intdigest()


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
        # name -> (identity of the file, fingerprint of bytes whose FNV-1a is the name), see the module doc string.
        self._verified: dict[str, tuple[Identity, int]] = {}
        # Drawn per process so that nobody who can write the cache directory knows what a fingerprint will be.
        self._seed = secrets.randbits(64)
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

    # ---- a core's effects ------------------------------------------------------------------------------------

    def carry_out(self, effect: Effect) -> int | bool | None:
        """Do what a connection's core asked (it waits meanwhile) and return the result it resumes with."""
        if isinstance(effect, FindEntry):
            size = self.entry_size(effect.digest)
            if size is None and self.wait_for_saves(effect.wait):
                size = self.entry_size(effect.digest)  # another connection was saving: maybe this very entry
            return size
        if isinstance(effect, LoadEntry):
            return self.load_into(effect.digest, effect.region)
        if isinstance(effect, SaveEntry):
            self.save(effect.data)
            return None
        raise TypeError(f"not a cache effect: {effect!r}")

    # ---- lookup ----------------------------------------------------------------------------------------------

    def entry_size(self, digest: int) -> int | None:
        """Size of the entry named after ``digest``, or None if there is none (nothing is read yet)."""
        try:
            return os.stat(self.path_for(digest)).st_size
        except OSError:
            return None

    def load(self, digest: int, size: int) -> np.ndarray | None:
        """The verified content of an entry of ``size`` bytes, or None (missing, changed size, or corrupt).

        A corrupt or short entry is deleted.  The caller has already checked that ``size`` bytes fit their
        destination, so nothing is allocated on the strength of a file alone.
        """
        path = self.path_for(digest)
        name = path.name
        out = np.empty(size, dtype=np.uint8)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                before = _identity(st)
                got = _read_full(f, memoryview(out))
                extra = f.read(1)
                after = _identity(os.fstat(f.fileno()))
        except OSError as exc:
            log.warning("cache: cannot read entry %s (%s): answered as a miss", name, exc)
            self._forget(name)
            return None
        if got < size:
            # Asked for at the size its file had a moment ago: a truncated entry (upstream's v6 server served those).
            log.warning("cache: entry %s is truncated (%d of %d bytes): deleted, answered as a miss", name, got, size)
            self._discard(name, st)
            return None
        if extra:
            log.warning("cache: entry %s grew past %d bytes while being read: answered as a miss", name, size)
            self._forget(name)
            return None
        actual = fnv1a64(out)
        if actual != digest:
            log.warning("cache: entry %s is corrupt (content hashes to %s): deleted, answered as a miss", name,
                        cache_file_name(actual))
            self._discard(name, st)
            return None
        fingerprint = _fingerprint(out, self._seed)
        with self._lock:
            if before == after:
                self._verified[name] = (after, fingerprint)
            else:
                # What was verified is right, but the file changed during the read: its identity predicts nothing.
                self._verified.pop(name, None)
            self._used(name, size)
        # The file's times are left alone (no utime): they are part of the identity a later hit checks.  Recency
        # lives in memory; a restarted server orders entries by the time they were saved.
        return out

    def load_into(self, digest: int, region: memoryview) -> bool:
        """Fill ``region`` with the verified content of the entry of ``region.nbytes`` bytes; False on a miss.

        An entry whose file still has the identity it had when its bytes were fingerprinted is read straight into
        ``region`` and answered as a hit only if what landed in ``region`` has that fingerprint; otherwise (and
        when the fingerprint differs) the entry is verified as :meth:`load` does, which leaves ``region`` untouched
        on a miss.
        """
        path = self.path_for(digest)
        name = path.name
        size = region.nbytes
        known = self._verified.get(name)
        if known is not None and known[0][2] == size and self._read_fingerprinted(path, region, known):
            with self._lock:
                self._used(name, size)
            return True
        data = self.load(digest, size)
        if data is None:
            return False
        region[:] = memoryview(data)
        return True

    def _read_fingerprinted(self, path: Path, region: memoryview, known: tuple[Identity, int]) -> bool:
        """Read the file straight into ``region`` if it still has the identity ``known`` holds; True only if the
        bytes now in ``region`` have the fingerprint of the bytes once verified (so they hash to the name)."""
        name = path.name
        identity, fingerprint = known
        size = region.nbytes
        try:
            with open(path, "rb", buffering=0) as f:
                if _identity(os.fstat(f.fileno())) != identity:
                    self._forget(name)  # changed visibly since: verified before a byte reaches the tensor
                    return False
                # Hashed in the tensor, as each piece lands: nothing but this thread writes there from then on, so
                # what is hashed is exactly what the client is told it has, whatever the file does meanwhile.
                got, landed = _read_fingerprinting(f, region, self._seed)
                extra = f.read(1)
        except OSError as exc:
            log.warning("cache: cannot read entry %s (%s): verifying it again", name, exc)
            self._forget(name)
            return False
        if got == size and not extra and landed == fingerprint:
            return True
        log.warning("cache: entry %s changed although its file's identity did not (%s): verifying it again", name,
                    "size" if got != size or extra else "content")
        self._forget(name)
        return False

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
                os.replace(temp, final)
                # After the rename, which changes ctime on most filesystems; the fd is the file just written even
                # if something has replaced the name since (the identity then differs and the next hit verifies).
                identity = _identity(os.fstat(fd))
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cache: could not save %s (%s): no entry written", name, exc.strerror or exc)
            try:
                os.unlink(temp)
            except OSError:
                pass
            return None
        self._fsync_dir()
        # ``view`` is what the file was written from and what ``digest`` was computed on (the caller's tensor,
        # which nothing writes during a save), so its fingerprint stands for bytes that hash to the name.
        fingerprint = _fingerprint(view, self._seed)
        with self._lock:
            self._entries[name] = size
            self._entries.move_to_end(name)
            self._verified[name] = (identity, fingerprint)
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

    def _discard(self, name: str, st: os.stat_result) -> None:
        """Delete the bad file ``st`` describes, unless a save has since renamed a new file over its name."""
        try:
            now = os.stat(self.directory / name)
        except OSError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            try:
                os.unlink(self.directory / name)
            except OSError:
                pass
        elif now is not None:
            self._forget(name)
            return
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
