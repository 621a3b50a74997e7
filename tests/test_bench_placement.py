"""Bench placement: the server is found by its listening port, and CPU placement is undone when a figure ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from ggml_rpc.bench.placement import client_on, listener_pid, placed, usable_cpus


def test_a_listening_socket_of_another_process_is_found_by_its_port() -> None:
    # A child process listens on a free loopback port and says which: the port leads to the child, not to us.
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
         "print(s.getsockname()[1], flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert listener_pid(port) == child.pid
    finally:
        child.kill()
        child.wait()


def test_a_port_nobody_listens_on_has_no_process() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: not a listener
        assert listener_pid(port) is None


def test_ipv6_listeners_are_found_too() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        s = socket.socket(socket.AF_INET6)
        s.bind(("::1", 0))
    except OSError:
        pytest.skip("::1 cannot be bound here")
    with s:
        s.listen()
        assert listener_pid(s.getsockname()[1]) == os.getpid()


def test_placement_is_undone_when_the_block_ends() -> None:
    cpus = usable_cpus()
    before = os.sched_getaffinity(0)
    with client_on({cpus[-1]}):
        assert os.sched_getaffinity(0) == {cpus[-1]}
    assert os.sched_getaffinity(0) == before
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child_before = os.sched_getaffinity(child.pid)
        with placed(child.pid, {cpus[0]}):
            assert os.sched_getaffinity(child.pid) == {cpus[0]}
        assert os.sched_getaffinity(child.pid) == child_before
    finally:
        child.kill()
        child.wait()
