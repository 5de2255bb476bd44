"""`multipod local --netns`'s pure logic: the machine's used networks, the run's range, names and
addresses, what is missing to make namespaces, the shaping qdisc, the throwaway certificates, the
workers' command lines and the CLI's checks. No namespace is made here (tests/e2e/test_netns.py
makes them)."""
from __future__ import annotations

import argparse
import ipaddress
import os
import stat

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from multipod.controller.commands.options import add_local_options, add_train_options
from multipod.controller.commands.train import check_netns_args
from multipod.controller.core.run_config import ConfigError
from multipod.controller.launch.certs import make_certificates
from multipod.controller.launch.netns import (
    CAP_NET_ADMIN,
    CAP_SYS_ADMIN,
    IFNAMSIZ,
    Layout,
    NetnsError,
    choose_subnet,
    missing_permissions,
    parse_used_networks,
    tbf_args,
)
from multipod.controller.launch.netns_pods import NetnsPods
from multipod.protos.channels import Security

ADDR = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
4: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever preferred_lft forever
9: mp77-0    inet 10.213.0.1/24 scope global mp77-0\\       valid_lft forever preferred_lft forever
"""
ROUTES = """\
default via 192.0.2.1 dev eth0
10.213.1.0/24 dev wg0 proto kernel scope link src 10.213.1.7
172.17.0.0/16 dev docker0 proto kernel scope link src 172.17.0.1 linkdown
local 127.0.0.1 dev lo table local proto kernel scope host src 127.0.0.1
broadcast 192.0.2.255 dev eth0 table local proto kernel scope link src 192.0.2.2
"""
USED = parse_used_networks(ADDR, ROUTES)


def test_the_machine_s_addresses_and_routes_are_read_as_used_networks():
    networks = {str(network) for network, _ in USED}
    assert {"127.0.0.0/8", "192.0.2.0/24", "10.213.0.0/24", "10.213.1.0/24", "172.17.0.0/16",
            "192.0.2.255/32"} == networks
    assert ("address 10.213.0.1/24 on mp77-0") in [where for _, where in USED]


def test_the_default_range_is_the_first_free_slash_24():
    # 10.213.0.0/24 has an address, 10.213.1.0/24 a route: the next one is free.
    assert choose_subnet(None, 5, USED) == ipaddress.IPv4Network("10.213.2.0/24")
    assert choose_subnet(None, 5, []) == ipaddress.IPv4Network("10.213.0.0/24")


@pytest.mark.parametrize("requested, says", [
    ("10.213.1.0/24", "already used on this machine (route 10.213.1.0/24 via wg0)"),
    ("10.213.0.128/25", "already used on this machine (address 10.213.0.1/24 on mp77-0)"),
    ("10.0.0.0/8", "already used on this machine"),
    ("8.8.8.0/24", "not a private range"),
    ("10.99.0.0/29", "6 usable address(es), the run needs 9"),
    ("10.99.0.1/24", "not an IPv4 network in CIDR form"),
    ("ten", "not an IPv4 network in CIDR form"),
])
def test_a_range_that_cannot_be_used_is_refused_naming_why(requested, says):
    with pytest.raises(NetnsError, match="--netns-subnet") as error:
        choose_subnet(requested, 9, USED)
    assert says in str(error.value)


def test_a_free_private_range_is_taken_as_given():
    assert choose_subnet("192.168.77.0/28", 9, USED) == ipaddress.IPv4Network("192.168.77.0/28")


def test_each_host_and_the_controller_get_their_own_address_and_names():
    layout = Layout("4194304-12", ipaddress.IPv4Network("10.213.2.0/24"), 3, 2)
    addresses = [layout.controller_ip] + [layout.host_ip(p, h) for p in range(3) for h in range(2)]
    assert len(set(addresses)) == 7 and layout.controller_ip == "10.213.2.1" and layout.host_ip(2, 1) == "10.213.2.7"
    assert all(ipaddress.ip_address(a) in layout.subnet for a in addresses)
    assert layout.namespaces == ["multipod-4194304-12-net"] + [f"multipod-4194304-12-p{p}h{h}"
                                                             for p in range(3) for h in range(2)]
    assert layout.root_link == "mp4194304-12" and len(layout.root_link) <= IFNAMSIZ
    with pytest.raises(NetnsError, match="too small"):
        Layout("1-0", ipaddress.IPv4Network("10.213.2.0/29"), 3, 2)


def test_what_is_missing_to_make_namespaces_is_named():
    everything = 1 << CAP_NET_ADMIN | 1 << CAP_SYS_ADMIN
    assert missing_permissions(everything, {"ip": "/usr/sbin/ip", "tc": "/usr/sbin/tc"}) == []
    missing = missing_permissions(1 << CAP_SYS_ADMIN, {"ip": None, "tc": "/usr/sbin/tc"})
    assert missing[0] == "the `ip` command (iproute2) on PATH" and "CAP_NET_ADMIN" in missing[1]
    assert len(missing) == 2
    assert "CAP_SYS_ADMIN" in " ".join(missing_permissions(1 << CAP_NET_ADMIN, {}))


def test_the_shaping_qdisc_holds_the_rate_and_a_burst_that_fits_an_offloaded_packet():
    assert tbf_args(1) == ["tbf", "rate", "1000000kbit", "burst", "625000", "latency", "50ms"]
    assert tbf_args(0.2)[:5] == ["tbf", "rate", "200000kbit", "burst", str(256 * 1024)]
    for bad in (0, -1):
        with pytest.raises(NetnsError, match="--netns-rate-gbps must be > 0"):
            tbf_args(bad)


def test_the_run_s_certificates_carry_each_worker_s_address_and_chain_to_the_run_s_ca(tmp_path):
    certs = make_certificates(tmp_path / "tls", {"pod0-host0": "10.213.0.2", "pod1-host0": "10.213.0.3"},
                              "10.213.0.1")
    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, ip in (("pod0-host0", "10.213.0.2"), ("pod1-host0", "10.213.0.3")):
        cert = x509.load_pem_x509_certificate(certs.servers[name].cert.read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(ip)]
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.SERVER_AUTH]
        cert.verify_directly_issued_by(ca)
    client = x509.load_pem_x509_certificate(certs.client.cert.read_bytes())
    client.verify_directly_issued_by(ca)
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    for pair in [*certs.servers.values(), certs.client]:
        assert stat.S_IMODE(os.stat(pair.key).st_mode) == 0o600
    assert not list((tmp_path / "tls").glob("ca*.key"))      # the CA's key is never written
    other = make_certificates(tmp_path / "other", {"x": "10.0.0.2"}, "10.0.0.1")
    with pytest.raises(InvalidSignature):      # a fresh CA per run: another run's does not sign ours
        client.verify_directly_issued_by(x509.load_pem_x509_certificate(other.ca.read_bytes()))
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    certs.remove()
    assert not (tmp_path / "tls").exists()


class _Made(NetnsPods):
    """NetnsPods as after its network and certificates are made, without making them."""

    def __init__(self, tmp_path, **kwargs):
        super().__init__(2, 2, tmp_path, security=Security(token="t" * 20), hosts_per_pod=2, **kwargs)
        self.network.layout = Layout("123-0", ipaddress.IPv4Network("10.213.5.0/24"), 2, 2)
        self.network.tools = {"ip": "/sbin/ip"}
        self.coordinators = [f"{self.listen_host(p, 0)}:4000" for p in range(2)]
        if self.encrypt:
            self.certificates = make_certificates(tmp_path / "tls", {f"pod{p}-host{h}": self.listen_host(p, h)
                                                                     for p in range(2) for h in range(2)}, "10.213.5.1")


def _flags(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


def test_a_worker_runs_in_its_host_s_namespace_with_its_own_certificate(tmp_path):
    pods = _Made(tmp_path)
    argv = pods.command(1, 1, "10.213.5.5:0", tmp_path / "port", "10.213.5.5:0")
    assert argv[:4] == ["/sbin/ip", "netns", "exec", "multipod-123-0-p1h1"]
    flags = _flags(argv)
    assert flags["--tls-cert"] == str(pods.certificates.servers["pod1-host1"].cert)
    assert flags["--tls-ca"] == str(pods.certificates.ca) and "--dcn-encrypt" in argv and "--insecure" not in argv
    assert pods.listen_host(1, 1) == "10.213.5.5" and flags["--pod-coordinator"] == "10.213.5.4:4000"
    controller = pods.controller_security
    assert controller.token == "t" * 20 and controller.tls_cert == str(pods.certificates.client.cert)
    plain = _Made(tmp_path / "plain", encrypt=False, insecure=True)
    argv = plain.command(0, 0, "10.213.5.2:0", tmp_path / "port", "10.213.5.2:0")
    assert "--insecure" in argv and "--dcn-encrypt" not in argv and "--tls-cert" not in argv
    assert plain.controller_security == plain.security


def test_netns_pods_refuse_the_user_s_certificates(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="makes the run's own certificates"):
        NetnsPods(1, 1, tmp_path, security=Security(token="t" * 20, tls_ca=str(cert)))


def _args(*argv: str, command: str = "local") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_local_options(parser)
    add_train_options(parser)
    args = parser.parse_args(list(argv))
    args.command = command
    return args


@pytest.mark.parametrize("argv, flag, says", [
    (("--netns-rate-gbps", "1"), "--netns-rate-gbps", "only goes with --netns"),
    (("--netns-subnet", "10.1.0.0/24"), "--netns-subnet", "only goes with --netns"),
    (("--insecure",), "--insecure", "only goes with --netns"),
    (("--netns", "--netns-rate-gbps", "0"), "--netns-rate-gbps", "must be > 0"),
    (("--netns", "--tls-ca", "ca.pem"), "--netns", "makes the run's own CA"),
])
def test_netns_options_that_do_not_go_together_are_refused(argv, flag, says):
    with pytest.raises(ConfigError, match=flag) as error:
        check_netns_args(_args(*argv), "local")
    assert says in str(error.value)


def test_netns_does_not_go_with_the_user_s_workers():
    with pytest.raises(ConfigError, match="does not go with --workers"):
        check_netns_args(_args("--netns", command="ptune"), "train")
