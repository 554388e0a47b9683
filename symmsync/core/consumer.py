"""What every consumer of a view shares: its lifetime.

A consumer (a collective, the direct-KV writer, the MoE dispatcher, yours) is made collectively
over the buffer's group and claims its bytes of the buffer (:mod:`.regions`). :class:`Consumer`
gives it one ``close()`` / ``with`` / ``closed`` with the same meaning everywhere:

* ``close()`` is collective over the buffer's group, like construction (every rank closes its
  objects in the same order): every member's calls on the object are over first (GPUs: the
  device is synchronized; then a barrier over the group), then its claims go on every member
  at once (:func:`.agreement.release_together`), so that a new owner of any layout may be made
  at the same bytes right after, and no member's new owner can overwrite a slot a slow member
  still reads. The object's calls raise :class:`~symmsync.ClosedError` from then on; its view,
  its fence channel and the other objects on the view are untouched. Idempotent.
* ``with Consumer(...) as c:`` closes it at the block's end; a block left by an exception
  closes on this rank only, with no barrier (the other members may not have raised).
* An object dropped without ``close()`` still releases its bytes when it is collected (on each
  rank when its garbage goes; the next construction over them collects first).

A consumer sets ``self._claims`` (what :func:`.agreement.release_together` releases) and
``self._buffer`` when it is made, and may override :meth:`_release` to let go of more (its
node steps, its signal memory).
"""

from __future__ import annotations

from typing import Any

from . import agreement


class Consumer:
    """The lifetime of a consumer of a view: ``close()``, ``with``, ``closed`` (the module's docstring)."""

    _closed = False
    _claims: Any = ()
    _buffer: Any = None

    def close(self, together: bool = True) -> None:
        """Release the object on every member at once (collective over the buffer's group, as its
        construction): every member's calls are over first, then its bytes are free on every
        member for a new owner of any layout; its calls raise :class:`~symmsync.ClosedError` from
        then on (:mod:`symmsync.core.consumer`). Idempotent.

        Args:
            together: ``False``: on this rank only, with no barrier (what a ``with`` block left by
                an exception does, when the other members may not come).

        Raises:
            BackendError: a member died or left before the barrier (the claims go all the same).
        """
        if self._closed:
            return
        self._closed = True
        self._release(together)

    def _release(self, together: bool) -> None:
        """Let go of what the object holds: its claims (together: after every member's calls are
        over). A consumer that holds more overrides this and calls it."""
        agreement.release_together(self._buffer, self._claims, together=together)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        self.close(together=kind is None)
