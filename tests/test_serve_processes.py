"""Helpers of ``inferscale serve`` that need no model: the port check and the CPU shares of
vLLM replicas on one CPU machine."""

from __future__ import annotations

import os
import socket

import pytest

from inferscale.server.ports import listen_on
from inferscale.server.vllm_process import cpu_shares


def test_a_port_whose_last_connections_linger_in_time_wait_is_free_again():
    """A server that answered clients and stopped leaves its side of those connections in
    TIME-WAIT for a minute; uvicorn binds with SO_REUSEADDR, and so must the check."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server closes first: its end goes to TIME-WAIT
    client.close()
    server.close()
    listen_on("127.0.0.1", port).close()  # raised "Address already in use" before


def test_a_port_someone_listens_on_is_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        with pytest.raises(OSError, match="choose another with --port"):
            listen_on("127.0.0.1", server.getsockname()[1])
    finally:
        server.close()


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_replicas_get_disjoint_shares_of_the_cores(n):
    cores = sorted(os.sched_getaffinity(0))
    shares = [[int(c) for c in s.split(",")] for s in cpu_shares(n)]
    assert len(shares) == n
    if n <= len(cores):
        assert sorted(c for s in shares for c in s) == cores  # every core once
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:
        assert all(len(s) == 1 and s[0] in cores for s in shares)


def test_replicas_on_a_multi_gpu_machine_get_a_gpu_each():
    from inferscale.server.vllm_process import gpu_shares

    assert gpu_shares(2, None, 4) == ["0", "1"]
    assert gpu_shares(3, None, 2) == ["0", "1", "0"]  # more replicas than GPUs: they share
    assert gpu_shares(2, "2,3", 2) == ["2", "3"]  # the user's CUDA_VISIBLE_DEVICES, split


@pytest.mark.parametrize("host,says", [("", "--host is empty"), ("999.1.1.1", "give one with --host"),
                                       ("http://127.0.0.1", "give one with --host")])
def test_a_bad_host_is_named_not_the_port(host, says):
    with pytest.raises(OSError, match=says) as caught:
        listen_on(host, 18999)
    assert "--port" not in str(caught.value) and "\n" not in str(caught.value)
