"""Run MaxText's trainer as one slice of a CPU multislice job (bench/vs_maxtext.py starts this with
MaxText's own Python 3.12, never with multipod's; it imports nothing of ours).

    MT_GLOO_HOST=10.213.0.2 python bench/maxtext_launch.py CONFIG key=value ...

Two patches, as in the peer recipe (shared/peers/maxtext/launch.py):
- gloo (jax's CPU collectives) binds to MT_GLOO_HOST, the address of this process's network
  namespace: by default it binds to what the host name resolves to, which is not an address
  the other namespace can reach.
- with MT_PROCESS_IS_GRANULE=1, MaxText's hybrid mesh takes each process as one slice (on CPU
  there is no slice index in the devices), so dcn_data_parallelism=2 puts the DCN axis between
  the two processes.
"""
import os
import runpy
import sys

from jax._src import xla_bridge

_make_gloo = xla_bridge._jax.make_gloo_tcp_collectives


def _gloo_on_namespace_address(distributed_client, hostname=None, interface=None):
    return _make_gloo(distributed_client=distributed_client, hostname=os.environ.get("MT_GLOO_HOST", "127.0.0.1"))


xla_bridge._jax.make_gloo_tcp_collectives = _gloo_on_namespace_address

if os.environ.get("MT_PROCESS_IS_GRANULE") == "1":
    from jax.experimental import mesh_utils
    _hybrid = mesh_utils.create_hybrid_device_mesh

    def _process_is_slice(*args, **kwargs):
        kwargs["process_is_granule"] = True
        return _hybrid(*args, **kwargs)
    mesh_utils.create_hybrid_device_mesh = _process_is_slice

sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("maxtext.trainers.pre_train.train", run_name="__main__", alter_sys=True)
