"""``MediaError``: what a source that cannot become encoder input raises, everywhere from the
read (``precompute.inputs.source_bytes``) through frame selection (``precompute.media.clips``) to decoding
(``precompute.media``). A module of its own so that each of those can raise it without
importing the others."""

from __future__ import annotations


class MediaError(ValueError):
    """A source file cannot be turned into encoder input; ``reason`` is short, for a rejects table."""

    def __init__(self, reason: str, uri: str = ""):
        super().__init__(f"{uri}: {reason}" if uri else reason)
        self.reason = reason
        self.uri = uri


class MissingMediaError(MediaError):
    """The source file is not there: a trainer re-reading media tells a user where to point
    ``--media`` instead of only saying that it is unreadable."""
