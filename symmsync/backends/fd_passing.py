"""Passing a file descriptor to the group's other ranks over a Unix socket (``SCM_RIGHTS``).

A POSIX file-descriptor handle of CUDA memory cannot travel as bytes: its owner serves
the descriptor on an abstract Unix socket (:class:`FdServer`), whose address travels
through the torch.distributed group in the handle, and each peer fetches it
(:func:`receive_fd`). Both ends check the kernel's credentials of the other
(``SO_PEERCRED``): the server answers only this user's processes whose ids the
group's exchange named, each once; the receiver takes a descriptor only from the
process named in the handle. docs/guarantees.md says what that protects against on a
shared host.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Collection

from ..errors import BackendError

__all__ = ["FdServer", "peer_credentials", "receive_fd"]

log = logging.getLogger("symmsync")

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket,
    as the kernel recorded them at connect time (``SO_PEERCRED``)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


class FdServer:
    """Hands one file descriptor to each of the group's other ranks, once, then closes.

    Listens on an abstract Unix socket (its name travels through the group). The
    process ids it may serve are the peers' (:meth:`expect`, from the same exchange
    that carried the socket's name); a connection that arrives before them waits for
    them. Every connection is checked with ``SO_PEERCRED``: the same effective user
    as this process and an expected process id not served yet get the descriptor;
    anything else gets nothing and is logged (logger ``"symmsync"``). Once every
    expected peer has its descriptor the socket closes.
    """

    def __init__(self, fd: int, owner: int = -1, wait_s: float = 60.0):
        self.fd = fd
        self.owner = owner
        self.wait_s = wait_s
        self.address = f"\0symmsync-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(64)
        self._expected: set[int] | None = None
        self._served: set[int] = set()
        self._known = threading.Event()
        self._closed = False
        self.thread = threading.Thread(target=self._serve, daemon=True, name="symmsync-fd-server")
        self.thread.start()

    def expect(self, pids: Collection[int]) -> None:
        """The process ids of the ranks that will connect (this process's excluded)."""
        self._expected = set(pids) - {os.getpid()}
        self._known.set()

    @property
    def served(self) -> frozenset[int]:
        """Process ids that received the descriptor."""
        return frozenset(self._served)

    def _serve(self) -> None:
        while True:
            if self._expected is not None and self._served >= self._expected:
                self._close_socket()  # every peer has its handle: nobody else may connect
                return
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    pid, uid, _gid = peer_credentials(conn)
                except OSError as e:
                    log.warning("rank %d: memory handle server: no credentials for a connection: %s", self.owner, e)
                    continue
                if not self._known.wait(self.wait_s):
                    log.warning(
                        "rank %d: memory handle server: the ranks' process ids never arrived; refused pid %d",
                        self.owner,
                        pid,
                    )
                    continue
                if self._closed:
                    return
                refusal = self._refusal(pid, uid)
                if refusal:
                    log.warning(
                        "rank %d: memory handle server refused pid %d (uid %d): %s", self.owner, pid, uid, refusal
                    )
                    continue
                try:
                    socket.send_fds(conn, [b"f"], [self.fd])
                except OSError as e:
                    log.warning("rank %d: could not send the memory handle to pid %d: %s", self.owner, pid, e)
                    continue
                self._served.add(pid)

    def _refusal(self, pid: int, uid: int) -> str | None:
        assert self._expected is not None
        if uid != os.geteuid():
            return f"another user (this job runs as uid {os.geteuid()})"
        if pid in self._served:
            return "that rank already received its handle"
        if pid not in self._expected:
            return f"not a rank of this group (ranks' pids: {sorted(self._expected)})"
        return None

    def _close_socket(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def close(self) -> None:
        self._close_socket()
        self._known.set()  # a connection waiting for the pids gives up now
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)


def receive_fd(address: str, owner: int, owner_pid: int | None = None) -> int:
    """Fetch rank ``owner``'s descriptor from the server at ``address``; refuse a server
    that is not this user's process ``owner_pid`` (the one named in the handle).

    Raises:
        BackendError: the connection failed, the server is another process, or it sent nothing.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        try:
            s.connect(address)
            pid, uid, _ = peer_credentials(s)
            if uid != os.geteuid() or (owner_pid is not None and pid != owner_pid):
                raise BackendError(
                    f"the socket named in rank {owner}'s handle belongs to pid {pid} (uid {uid}), not to rank "
                    f"{owner} (pid {owner_pid}, uid {os.geteuid()}): refusing it"
                )
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
        except OSError as e:
            raise BackendError(f"could not receive rank {owner}'s memory handle over a Unix socket: {e}") from e
    if not fds:
        raise BackendError(
            f"rank {owner} sent no memory handle (its server refused this process: see the 'symmsync' log on rank "
            f"{owner})"
        )
    return fds[0]
