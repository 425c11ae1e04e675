"""Two dev clusters on one machine never hand the same loopback address to two pods."""
from __future__ import annotations

import subprocess
import sys

from graft.devcluster.podrunner import IpLease

IP = "127.0.0.251"   # outside the ranges the dev clusters use, so a running one cannot interfere


def test_a_held_address_is_refused_until_it_is_released():
    lease = IpLease.take(IP)
    assert lease is not None
    try:
        assert IpLease.take(IP) is None
    finally:
        lease.release()
    again = IpLease.take(IP)
    assert again is not None
    again.release()


def test_another_process_sees_the_lease_and_it_ends_with_its_holder():
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from graft.devcluster.podrunner import IpLease\n"
        f"assert IpLease.take({IP!r}) is not None\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert IpLease.take(IP) is None
    finally:
        holder.kill()
        holder.wait()
    lease = IpLease.take(IP)   # the kernel dropped the dead holder's lock: nothing to clean up
    assert lease is not None
    lease.release()
