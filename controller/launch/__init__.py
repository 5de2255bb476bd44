"""Where the workers come from when the controller starts them.

  local            `multipod local`: simulated pods as supervised subprocesses on this machine
  netns            `--netns`: one network namespace per host, bridges, veth links, tbf shaping, cleanup
  netns_pods       `--netns`: LocalPods whose workers run in those namespaces, with TLS and CURVE
  ports            ports picked before a worker starts, below the kernel's ephemeral range
  certs            a throwaway CA and certificates for a run whose workers listen beyond loopback
  ray_cluster      `multipod ray`'s request to a Ray cluster: checks, resources, connecting
  ray_context      `multipod ray` as the training run enters it: connect, start the pods, say where
  ray_pods         `multipod ray`: one placement group per pod, one actor per host, the monitor
  ray_host_specs   each host's worker flags and environment, and the check that remote ones encrypt
  ray_replacement  a pod Ray will not bring back at its address: a spare placed, offered, swapped in
  ray_worker       one host of one pod under Ray: the actor that runs `multipod worker`
"""
