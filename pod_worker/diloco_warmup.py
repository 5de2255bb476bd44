"""DiLoCo's outer programs run once at configure (sync.mode = "diloco"), a mixin of OuterSync
(diloco.py). The first outer sync of each fragment would otherwise compile that fragment's
programs mid-run, on every pod at once: its pseudo-gradient, its outer optimizer step, the copy
the pod's fragment takes, on a pod of several hosts its gather (diloco_hosts.py), and the
checksum of the agreed state after it. Run at configure instead (Pod._build, before the data
plane exists), they compile there, or load from the compilation cache pod 0 filled when the pods
share one (Cluster.configure).

Every input is a throwaway of the same shape, dtype and sharding as the real one: copies of the
agreed values and of the pod's parameters, a fresh outer optimizer state, and zeros where the
exchange's pod-order sum would come in. Nothing is exchanged and the outer state is not touched:
the run after it is bitwise the run without it."""
from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np


class OuterWarmUp:
    """The warm-up part of OuterSync: it works on OuterSync's fragments, programs, agreed values,
    states, shardings and hosts."""

    def warm_up(self, params, checksum: Callable[[object, list], object]) -> None:
        """Run each fragment's outer programs once, fragment by fragment in order (the order every
        host of a pod runs the gathers in), on throwaway inputs shaped as `params` (the pod's
        parameters, only copied); after each fragment, `checksum(agreed tree, outer states)` of
        the agreed state as that fragment's outer step would leave it (the trainer's checksum
        program; its inputs then carry the update's outputs as a real run's do)."""
        local = jax.tree.leaves(params)
        agreed, states = list(self.agreed), list(self.states)
        for fragment, (program, indices) in enumerate(zip(self._programs, self.fragments)):
            mine = program["copy"]([self.agreed[i] for i in indices])
            delta = program["delta"](mine, program["copy"]([local[i] for i in indices]))
            if self.num_pods == 1:      # one pod's sum is its own pseudo-gradient (OuterSync._submit)
                summed = delta
            elif self.hosts is not None:
                # A collective of the pod's hosts: each runs this at configure, fragment by
                # fragment, as it runs the other warm-ups' programs (PodTrainer.warm_up).
                summed = self.hosts.gather(fragment, self.hosts.zeros(fragment))
            else:
                summed = [jax.device_put(np.zeros(self.agreed[i].shape, self.agreed[i].dtype), self._shardings[i])
                          for i in indices]
            new, state = program["update"](mine, program["init"](mine), summed, np.float32(self.num_pods))
            program["copy"](new)
            for i, value in zip(indices, new):
                agreed[i] = value
            states[fragment] = state
            jax.block_until_ready(checksum(jax.tree.unflatten(self._treedef, agreed), states))
