"""The flags of `multipod generate` that choose its pod and mesh (controller/commands/generate_options.py):
a local pod of several hosts, or a running pod (--workers), each refused clearly where it cannot work."""
import argparse

import pytest

from multipod.controller.commands.generate_options import add_arguments, apply_layout, check_mesh, check_pod_flags
from multipod.controller.core.run_config import ConfigError, load_config
from tests.helpers import TINY


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--checkpoint", "c", "--prompt", "x", *argv])


def test_a_running_pod_is_one_pod_of_the_hosts_given_and_brings_its_own_devices():
    args = _args("--workers", "10.0.0.1:50051, 10.0.0.2:50051")
    assert check_pod_flags(args) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    apply_layout(args)
    assert (args.devices, args.hosts_per_pod, args.model_parallel) == (None, None, 1)
    assert check_pod_flags(_args("--workers", "10.0.0.1:50051,10.0.0.2:50051;")) == \
        ["10.0.0.1:50051", "10.0.0.2:50051"]
    with pytest.raises(ConfigError, match=r"--workers: generation runs on one pod: .* \(got 2 pods"):
        check_pod_flags(_args("--workers", "a:1;b:2"))
    for flag in ("--devices", "--hosts-per-pod"):
        with pytest.raises(ConfigError, match=f"{flag}: sets up a local pod"):
            check_pod_flags(_args("--workers", "a:1", flag, "2"))
    local = _args("--devices", "2")
    assert check_pod_flags(local) is None
    apply_layout(local)
    assert (local.devices, local.hosts_per_pod) == (2, 1)


def test_the_mesh_must_fit_the_pod_s_hosts_the_model_and_the_batch():
    config = load_config(TINY)     # 4 heads, a batch of 8 sequences
    check_mesh(4, 2, 2, config)
    check_mesh(2, 2, 1, config)
    cases = {(3, 2, 1): "--hosts-per-pod: must be >= 1 and divide the pod's 3 devices, got 2",
             (2, 2, 2): "--model-parallel: 2 does not divide the 1 devices of each of the pod's 2 hosts",
             (4, 1, 3): "--model-parallel: must be >= 1 and divide the pod's 4 devices, got 3",
             (0, 1, 1): "--devices: must be >= 1",
             (3, 1, 1): "--devices: 3 devices / --model-parallel 1 make a data axis of 3"}
    for (devices, hosts, parallel), message in cases.items():
        with pytest.raises(ConfigError, match=message):
            check_mesh(devices, hosts, parallel, config)
