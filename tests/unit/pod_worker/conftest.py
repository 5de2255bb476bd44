"""Fixtures of the pod_worker unit tests."""
import jax
import pytest


@pytest.fixture
def pods_on_device_0(monkeypatch) -> None:
    """Have every in-process Pod build its trainer on device 0 alone, for the modules that run
    several Pods side by side in threads of this process (`pytestmark =
    pytest.mark.usefixtures("pods_on_device_0")`).

    Pods that each span the process's 4 simulated devices run programs with collectives over the
    same devices from several threads at once. XLA CPU's in-process rendezvous can then pair one
    program's participants with another's: each device waits for a peer busy in the other
    program, and after 40 s XLA aborts the whole process ("Termination timeout for `all reduce
    RendezvousKey...`", then SIGABRT). That was the test process that crashed in
    test_diloco.py on 2026-12-02 and 2026-12-03 (2 runs in 25 of its pod tests beside two CPU
    hogs). A worker never does it: one pod per process, one step at a time. One-device programs
    have no collectives, and pods on one device share their compiled programs."""
    from multipod.pod_worker import pod as pod_module
    from multipod.pod_worker.trainer import PodTrainer

    class OnDevice0(PodTrainer):
        def __init__(self, config, devices=None, layout=None, initial_state=True):
            super().__init__(config, [jax.devices()[0]], layout, initial_state)
    monkeypatch.setattr(pod_module, "PodTrainer", OnDevice0)
