"""A size-bounded diskcache folder that never breaks its caller; the answer cache and the image-feature store are
two of them."""
import logging
import os
import threading

import diskcache

from qvl.sizes import auto_size, parse_size

log = logging.getLogger("qvl")


class _NoPickleDisk(diskcache.Disk):
    """Loads only plain values: a pickled one (planted by another program) reads as missing, never unpickled."""

    def fetch(self, mode, filename, value, read):
        if mode == diskcache.core.MODE_PICKLE:
            raise OSError("pickled value refused")  # diskcache treats an unreadable value as a missing key
        return super().fetch(mode, filename, value, read)


def _file_id(path: str):
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


class DiskStore:
    """A size-bounded diskcache folder that never breaks its caller: when it cannot be used (unwritable, corrupted,
    deleted and not recreatable) one warning is logged, reads miss and writes are dropped, and error says why;
    clear() tries it again. A folder deleted or replaced while open is started afresh."""

    def __init__(self, directory: str, size_limit: int | str = "auto", enabled: bool = True, what: str = "cache"):
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.size_limit = auto_size(self.directory) if size_limit == "auto" else parse_size(size_limit)
        self.enabled = enabled  # switched live from the Settings tab
        self.what = what  # names the store in warnings
        self.error: str | None = None
        self._cache: diskcache.Cache | None = None
        self._db_id = None
        self._lock = threading.Lock()
        if enabled:
            self._live()  # a broken directory is reported at start-up, not at the first question

    def read(self, key: str):
        """The stored value, or None: absent, unreadable, or the store unusable."""
        cache = self._live()
        if cache is None:
            return None
        try:
            return cache.get(key)
        except diskcache.Timeout:  # another process holds the lock for long: a miss, not a broken store
            return None
        except Exception as e:
            self._fail(e)
            return None

    def write(self, key: str, value) -> bool:
        cache = self._live()
        if cache is None:
            return False
        try:
            return cache.set(key, value)
        except diskcache.Timeout:
            return False
        except Exception as e:
            self._fail(e)
            return False

    def delete(self, key: str) -> None:
        cache = self._live()
        if cache is not None:
            try:
                cache.delete(key)
            except Exception as e:
                self._fail(e)

    def clear(self) -> None:
        """Empty the store; after a fault, try the directory again first."""
        self.error = None
        cache = self._live()
        if cache is not None:
            try:
                cache.clear()
            except Exception as e:
                self._fail(e)

    def volume(self) -> tuple[int, int]:
        """(entries, bytes) on disk."""
        cache = self._live()
        if cache is not None:
            try:
                return len(cache), cache.volume()
            except Exception as e:
                self._fail(e)
        return 0, 0

    def _live(self) -> diskcache.Cache | None:
        """The open cache, reopened when its directory was deleted or replaced; None when off or unusable."""
        if not self.enabled or self.error:
            return None
        db = os.path.join(self.directory, diskcache.core.DBNAME)
        with self._lock:
            if self._cache is not None and _file_id(db) == self._db_id:
                return self._cache
            replaced = self._cache is not None
            if replaced:  # SQLite would go on writing into the deleted file, and every write would be lost
                self._cache.close()
            try:
                self._cache = diskcache.Cache(  # timeout: wait for another process's write 2 s, then miss
                    self.directory, timeout=2, disk=_NoPickleDisk, size_limit=self.size_limit,
                    eviction_policy="least-recently-used",
                    cull_limit=1,  # evict one least-recently-used entry per write, not a batch of ten
                )
                self._db_id = _file_id(db)
                if replaced:
                    log.warning("%s %s was deleted or replaced; started a new one there", self.what, self.directory)
            except Exception as e:
                self._cache = None
                self._fail_locked(e)
            return self._cache

    def _fail(self, error: Exception) -> None:
        with self._lock:
            self._fail_locked(error)

    def _fail_locked(self, error: Exception) -> None:
        if self.error:
            return
        self.error = f"{type(error).__name__}: {error}"
        log.warning(
            "%s %s is unusable (%s); answering without it. Delete or fix the folder, or choose another "
            "with --cache-dir, then press Clear in Settings to retry.", self.what, self.directory, self.error,
        )
        if self._cache is not None:
            try:
                self._cache.close()
            except Exception:  # closing a broken database can fail too; it is dropped either way
                pass
            self._cache = None
