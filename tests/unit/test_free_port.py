"""Ports for the embedded servers: one process never hands out the same port twice."""

from charge_worker.sandbox.embedded import free_port


def test_free_port_never_repeats_a_port_it_handed_out() -> None:
    # A cluster picks a dozen ports (client, cluster, monitor, route proxies) before any
    # server binds one; a repeat among them made a node exit with "address already in use".
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
