"""HOST:PORT as both sides check it (protos/cli_flags.py): the controller's --workers and a
worker's --listen and --dcn-listen are refused at once when they are not addresses, instead of a
30-second wait for a host named "foo" or gRPC serving a port beyond 65535 on another port."""
import pytest

from multipod.protos.cli_flags import host_port_problem


@pytest.mark.parametrize("address", ["127.0.0.1:50051", "node-3.cluster:1", "[::1]:50051", " 10.0.0.2:65535 "])
def test_addresses_that_are_host_port(address):
    assert host_port_problem(address) is None


@pytest.mark.parametrize("address, why", [
    ("foo", "is not HOST:PORT"), (":50051", "is not HOST:PORT"), ("host:", "the port must be a number from 1"),
    ("host:99999", "from 1 to 65535"), ("host:-1", "from 1 to 65535"), ("host:5x", "must be a number"),
    ("::1:5", "an IPv6 host goes in brackets")])
def test_addresses_that_are_not(address, why):
    assert why in host_port_problem(address)


def test_port_zero_only_where_it_is_listened_on():
    assert "from 1 to 65535" in host_port_problem("127.0.0.1:0")
    assert host_port_problem("127.0.0.1:0", listen=True) is None
    assert "from 0 to 65535" in host_port_problem("127.0.0.1:65536", listen=True)
