"""The process watch's reading of a process (symmsync.core.liveness), in one process: this process
is alive; a child that ended is not, whether its parent reaped it yet (a zombie) or not; a pid
whose start time differs (a reused pid) is not the process it names; processes of another host
or pid namespace are not comparable (never watched)."""

import os
import subprocess
import sys
import time

from symmsync.core import liveness


def test_this_process_is_alive_and_comparable_with_itself():
    me = liveness.identity()
    assert me is not None and me[2] == os.getpid()
    assert liveness.alive(me) and liveness.comparable(me, me)


def test_a_child_that_ended_is_dead_zombie_or_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = int(open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[19])
        me = liveness.identity()
        theirs = (me[0], me[1], child.pid, start)
        assert liveness.alive(theirs)
        assert not liveness.alive((me[0], me[1], child.pid, start + 1))  # a reused pid: another process
        child.kill()
        deadline = time.monotonic() + 10
        while liveness.alive(theirs):  # not reaped yet: a zombie, which has ended
            assert time.monotonic() < deadline, "a killed child still reads as alive"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert not liveness.alive(theirs)  # reaped: gone


def test_another_host_or_pid_namespace_is_not_comparable():
    me = liveness.identity()
    assert not liveness.comparable(me, ("another boot", me[1], 1, 1))
    assert not liveness.comparable(me, (me[0], "pid:[1]", 1, 1))
    assert not liveness.comparable(me, None) and not liveness.comparable(None, me)
