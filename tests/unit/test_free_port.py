"""Ports picked for a master or a node to listen on stay clear of the ports the kernel hands
to outgoing connections, which any process can take between the pick and the bind."""

import socket

from master.platform import local


def _listen(port):
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_picked_ports_lie_below_the_kernels_range_for_outgoing_connections():
    low = local._ephemeral_low()
    ports = {local.free_port() for _ in range(20)}
    assert all(local.LISTEN_PICK_LOW <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # picked at random, not one port again and again
    for port in ports:
        _listen(port).close()


def test_without_room_below_that_range_the_kernel_picks(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("20500\t60999\n")
    monkeypatch.setattr(local, "EPHEMERAL_RANGE_FILE", str(ranges))
    assert local._ephemeral_low() == 20500
    for _ in range(20):
        port = local.free_port()
        assert port >= 20500
        _listen(port).close()


def test_an_unreadable_range_file_means_linuxs_default(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert local._ephemeral_low() == 32768
    assert local.LISTEN_PICK_LOW <= local.free_port() < 32768
