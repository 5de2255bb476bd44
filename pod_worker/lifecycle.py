"""The worker process's life: start the server, announce the port, run until told to stop (the
Shutdown RPC, SIGTERM, Ctrl-C, or the parent process going away), then stop in order."""
from __future__ import annotations

import logging
import os
import signal

from multipod.pod_worker.server import RPC_THREADS, start_server
from multipod.protos.channels import Security

log = logging.getLogger(__name__)


def write_port_file(port_file: str, port) -> None:
    """Write the bound port atomically: whoever polls the file never reads half of it."""
    tmp = f"{port_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, port_file)


def serve(pod_index: int | None, listen: str, port_file: str | None = None, exit_with_parent: bool = False,
          max_workers: int = RPC_THREADS, security: Security | None = None, dcn_listen: str | None = None,
          dcn_encrypt: bool = False, layout=None) -> None:
    """Serve one pod until Shutdown is called, the process is signalled, or (with
    exit_with_parent) the process that started it is gone. The data plane listens on dcn_listen
    (default: the gRPC host, an ephemeral port); with a port file, its address goes to
    PORT_FILE.dcn (written first), so a launcher can restart the worker on the same endpoint."""
    server, service, health_servicer, port = start_server(pod_index, listen, security, max_workers,
                                                          dcn_listen=dcn_listen, dcn_encrypt=dcn_encrypt,
                                                          layout=layout)
    shutdown = service.shutdown_event
    host = listen.rsplit(":", 1)[0]
    log.info("%s serving on %s:%d (pid %d), data plane on %s", service.pod.layout.name(pod_index), host, port,
             os.getpid(), service.pod.listener.address)
    if port_file:   # written last: whoever waits on it may connect at once
        try:
            write_port_file(f"{port_file}.dcn", service.pod.listener.address)
            write_port_file(port_file, port)
        except OSError as exc:      # a full disk, say: nobody would find this worker, so it stops
            server.stop(grace=None)
            service.pod.close()
            raise SystemExit(f"error: --port-file {port_file}: cannot write it: {exc.strerror or exc}") from None
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: shutdown.set())
    try:
        while not shutdown.wait(0.5):
            if exit_with_parent and os.getppid() != parent:
                log.warning("parent process %d is gone; shutting down", parent)
                break
    except KeyboardInterrupt:
        pass
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=2.0).wait(5.0)
    service.pod.close()
    log.info("%s stopped", service.pod.layout.name(service.pod.pod_index))
