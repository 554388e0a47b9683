"""The CUDA backend's descriptor server hands its memory's handle only to the group's ranks.

``FdServer`` serves any file descriptor, so these tests need no GPU: it serves a temp
file whose bytes the receiver reads back. The processes that connect are real
processes: the server learns who they are from the kernel (``SO_PEERCRED``), not
from anything they send.
"""

import logging
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from symmsync import BackendError
from symmsync.backends.fd_passing import FdServer, receive_fd

ROOT = Path(__file__).resolve().parents[2]
CONTENT = b"the memory of rank 0"

# A process that asks the server for the descriptor `tries` times and prints what it got:
# the file's bytes through the descriptor, "nothing" (served no descriptor), or
# "refused" (no server listens any more, or it closed before serving this connection).
# With ANNOUNCE set it first prints "connected" once its connection is established (the
# kernel queued it and recorded its credentials): a handshake the test can wait for.
CLIENT = """
import os, socket, sys, time
address = bytes.fromhex(sys.argv[1]).decode()
if len(sys.argv) > 3:  # become another user (started as root): same process, same pid
    os.setgid(int(sys.argv[3]))
    os.setuid(int(sys.argv[3]))
for _ in range(int(sys.argv[2])):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        try:
            s.connect(address)
            if os.environ.get("ANNOUNCE"):
                print("connected", flush=True)
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
        except (ConnectionRefusedError, ConnectionResetError, FileNotFoundError):
            print("refused", flush=True)  # no server, or it closed with this connection waiting
            continue
    if fds:
        print(os.pread(fds[0], 100, 0).decode(), flush=True)
        os.close(fds[0])
    else:
        print("nothing", flush=True)
    time.sleep(0.2)
"""


@pytest.fixture
def served_file():
    with tempfile.TemporaryFile() as f:
        f.write(CONTENT)
        f.flush()
        yield f.fileno()


def _client(server: FdServer, tries: int = 1, uid: int | None = None, announce: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-c", CLIENT, server.address.encode().hex(), str(tries)]
    cmd += [str(uid)] if uid is not None else []
    env = dict(os.environ, ANNOUNCE="1") if announce else None
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _lines(proc: subprocess.Popen) -> list[str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out.splitlines()


def test_a_process_that_is_not_a_rank_gets_nothing_and_is_logged(served_file, caplog):
    server = FdServer(served_file, owner=0)
    try:
        rank = _client(server)
        # pid 1 stands for a rank that never connects, so the server stays up for the
        # stranger whenever it comes; its own pid is never a peer of itself.
        server.expect([rank.pid, 1, os.getpid()])
        with caplog.at_level(logging.WARNING, logger="symmsync"):
            stranger = _client(server)
            assert _lines(stranger) == ["nothing"]
        assert f"refused pid {stranger.pid}" in caplog.text and "not a rank of this group" in caplog.text
        assert _lines(rank) == [CONTENT.decode()]
        assert server.served == {rank.pid} and server.thread.is_alive()
    finally:
        server.close()


def test_a_rank_gets_the_descriptor_exactly_once(served_file, caplog):
    server = FdServer(served_file, owner=0)
    try:
        rank = _client(server, tries=2)
        server.expect([rank.pid, 1])  # pid 1 stands for a rank that has not connected yet
        with caplog.at_level(logging.WARNING, logger="symmsync"):
            assert _lines(rank) == [CONTENT.decode(), "nothing"]
        assert "already received its handle" in caplog.text
    finally:
        server.close()


def test_the_server_closes_once_every_rank_has_its_descriptor(served_file):
    server = FdServer(served_file, owner=0)
    try:
        rank = _client(server, tries=2)  # its second try finds no server
        server.expect([rank.pid])
        assert _lines(rank) == [CONTENT.decode(), "refused"]
        server.thread.join(timeout=10)
        assert not server.thread.is_alive()
    finally:
        server.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a process as another user")
def test_a_process_of_another_user_gets_nothing_even_with_a_ranks_pid(served_file, caplog):
    server = FdServer(served_file, owner=0)
    try:
        other = _client(server, uid=65534)  # nobody; an abstract socket checks no permission
        server.expect([other.pid])
        with caplog.at_level(logging.WARNING, logger="symmsync"):
            assert _lines(other) == ["nothing"]
        assert "another user" in caplog.text
    finally:
        server.close()


def test_the_receiver_takes_the_descriptor_only_from_the_rank_named_in_the_handle(served_file):
    server = FdServer(served_file, owner=0)
    try:
        server.expect([os.getpid() + 10**6, 1])  # nobody that connects here is expected: stays up
        with pytest.raises(BackendError, match="not to rank 0"):
            receive_fd(server.address, owner=0, owner_pid=os.getpid() + 1)  # the handle named another pid
    finally:
        server.close()


def test_a_connection_before_the_ranks_are_known_waits_for_them(served_file):
    server = FdServer(served_file, owner=0)
    try:
        rank = _client(server, announce=True)
        # The handshake: its connection is established before the server learns the ranks.
        assert rank.stdout.readline() == "connected\n"
        server.expect([rank.pid])
        assert _lines(rank) == [CONTENT.decode()]
    finally:
        server.close()


def test_a_closed_server_refuses_connections(served_file):
    server = FdServer(served_file, owner=0)
    server.close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, pytest.raises(ConnectionRefusedError):
        s.connect(server.address)
