"""User-facing errors. Each is a ``ValueError`` so callers can catch bad input in one place;
messages name the object at fault and, where there is one, what to do about it."""


class FeatstoreError(ValueError):
    """Base of every error the feature store raises for bad input or a bad store."""


class ConfigError(FeatstoreError):
    """A config file or ``--set`` override is invalid (unknown key, wrong type, ...)."""


class SchemaError(FeatstoreError):
    """A sample does not match the store's schema (missing field, wrong dtype or ndim)."""


class NonFiniteError(SchemaError):
    """A sample's float field holds NaN or infinity: a writer refuses it unless the field is
    allowed them (``StoreWriter(allow_nonfinite=...)``), so nothing trains on it unknowingly."""


class MissingFieldError(SchemaError, KeyError):
    """A sample does not have a field the store holds (it was added to the store after the
    sample was written, and not yet encoded for it)."""

    __str__ = ValueError.__str__  # KeyError would quote the message


class StoreExistsError(SchemaError):
    """A store was to be created where one is already (another job may have just made it)."""


class DuplicateSampleError(FeatstoreError):
    """A sample id is already in the store or in the shard being written."""


class ShardCommittedError(DuplicateSampleError):
    """Another writer committed a shard of this name first (its copy is kept, this one dropped)."""


class NotAStoreError(FeatstoreError):
    """The URL does not hold an mmcache feature store."""


class FormatVersionError(FeatstoreError):
    """The store was written by a newer format version than this mmcache can read."""


class ReadOnlyError(FeatstoreError):
    """A write was attempted through a store opened for reading."""


class CorruptionError(FeatstoreError):
    """Stored bytes do not match their checksum, or the index and the data disagree."""


class FingerprintMismatchError(FeatstoreError):
    """Features were made by a different encoder (or settings) than the caller expects."""


class StorageError(FeatstoreError):
    """Reading or writing an object failed for a reason other than bad data: a transient fault
    (HTTP 5xx, throttling, reset, timeout) that outlasted the retries, or a permission problem.
    The message names the object; credentials and signed URLs are redacted from it."""


class SnapshotError(FeatstoreError):
    """A requested snapshot of committed shards cannot be opened (a listed shard is gone)."""
