"""`multipod local --netns`: LocalPods whose workers each run in a network namespace of their own
(controller/launch/netns.py), so every byte between pods, and between the controller and a pod,
crosses a kernel link (shaped with --netns-rate-gbps).

The workers listen on their namespace's address, beyond loopback, so the security rules apply as
on real hosts: by default the run makes a throwaway CA and certificates (controller/launch/
certs.py), its workers serve gRPC with TLS and require the controller's client certificate, and
their data planes are CURVE-encrypted (--dcn-encrypt). With insecure, both planes are plain and
the workers are told so (--insecure). The supervisor restarts a worker in its own namespace on its
old address and ports, as LocalPods does on loopback.

Start: the network, then the certificates, then the workers. Stop (also after a start that failed
halfway, or Ctrl-C): the workers, then the certificates, then the network.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys

from multipod.controller.launch.certs import RunCertificates, make_certificates
from multipod.controller.launch.local import LocalPods
from multipod.controller.launch.netns import Network
from multipod.protos.channels import Security


class NetnsPods(LocalPods):
    """LocalPods in network namespaces. subnet: the run's IPv4 range (CIDR; None: a free /24 of
    10.213.0.0/16); rate_gbps: shape each pod's link (0: unshaped); encrypt: TLS and CURVE with
    the run's own certificates; insecure: pass --insecure to the workers (needed when not
    encrypting, or they refuse to start). Other arguments as LocalPods'."""

    def __init__(self, num_pods: int, devices_per_pod, log_dir: pathlib.Path, subnet: str | None = None,
                 rate_gbps: float = 0.0, encrypt: bool = True, insecure: bool = False, **kwargs):
        if encrypt:
            kwargs["dcn_encrypt"] = True
        super().__init__(num_pods, devices_per_pod, log_dir, **kwargs)
        if self.security.tls:
            raise ValueError("--netns makes the run's own certificates: leave out --tls-cert, --tls-key, "
                             "--tls-ca and --tls-server-name")
        self.network = Network(self.total, self.hosts_per_pod, subnet, rate_gbps)   # spares too
        self.encrypt, self.insecure = encrypt, insecure
        self.certificates: RunCertificates | None = None

    def listen_host(self, pod: int, host: int) -> str:
        assert self.network.layout is not None, "the network is made in start()"
        return self.network.layout.host_ip(pod, host)

    @property
    def controller_security(self) -> Security:
        """The controller's credentials for these workers: its client certificate and the run's
        CA with TLS, its token alone without."""
        if self.certificates is None:
            return self.security
        return dataclasses.replace(self.security, tls_cert=str(self.certificates.client.cert),
                                   tls_key=str(self.certificates.client.key), tls_ca=str(self.certificates.ca))

    def describe(self) -> str:
        """Where the pods run, for the start's message."""
        layout = self.network.layout
        assert layout is not None
        rate = f"links shaped to {self.network.rate_gbps:g} Gb/s" if self.network.rate_gbps else "links unshaped"
        security = "TLS + CURVE" if self.encrypt else "UNENCRYPTED (--insecure)"
        return (f"in network namespaces {layout.prefix}* ({layout.subnet}, controller {layout.controller_ip}, "
                f"{rate}, {security})")

    def start(self) -> None:
        layout = self.network.create()
        if self.network.cleaned:
            print(f"netns: removed what killed runs had left: {', '.join(self.network.cleaned)}",
                  file=sys.stderr, flush=True)
        if self.encrypt:
            servers = {self._cert_name(p, h): layout.host_ip(p, h)
                       for p in range(self.total) for h in range(self.hosts_per_pod)}
            self.certificates = make_certificates(self.log_dir / ".tls", servers, layout.controller_ip,
                                                  run_name=f"multipod {layout.prefix.rstrip('-')}")
        super().start()

    def stop(self, grace_s: float = 5.0) -> None:
        try:
            super().stop(grace_s)
        finally:
            if self.certificates is not None:
                self.certificates.remove()
            self.network.destroy()

    def command(self, pod: int, host: int, listen: str, port_file: pathlib.Path, dcn_listen: str) -> list[str]:
        cmd = super().command(pod, host, listen, port_file, dcn_listen)
        if self.certificates is not None:
            pair = self.certificates.servers[self._cert_name(pod, host)]
            cmd += ["--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--tls-ca", str(self.certificates.ca)]
        if self.insecure:
            cmd.append("--insecure")
        return self.network.wrap(pod, host, cmd)

    @staticmethod
    def _cert_name(pod: int, host: int) -> str:
        return f"pod{pod}-host{host}"
