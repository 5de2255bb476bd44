"""DiLoCo's outer exchange on a pod of several hosts (sync.mode = "diloco"), with the scheme of
every step's exchange (pod_worker/hosts.py): every host holds the whole pseudo-gradient of a
fragment; host h of every pod exchanges only block h of each of the fragment's leaves (the blocks
of hosts.Assembler.block, so the data plane's plan is the one every step's exchange uses) with
host h of the other pods, and when the outer step is applied one compiled program per fragment
(an Assembler of its leaves) gathers the summed blocks on every device of the pod.

The exchange runs on the outer-sync thread and reads only this host's copy of the
pseudo-gradient. The gather is a collective of the pod's hosts: it runs on the step's thread, at
the same inner step on every host (the schedule is a function of the step count), whether the
host's exchange succeeded or not, and it tells every host whether every host had its blocks. So
a sync that failed on one host fails on all of them, each with its state as it was."""
from __future__ import annotations

import numpy as np

from multipod.pod_worker.dcn import ExchangeError
from multipod.pod_worker.hosts import Assembler, HostBlock


class HostFragments:
    """The block split and the gather of every fragment. `assembler`: the trainer's (its blocks
    are those of the data plane's plan); `fragments`: the leaf indices of each fragment;
    `dtypes`: every leaf's dtype."""

    def __init__(self, assembler: Assembler, fragments: list[list[int]], dtypes: list[np.dtype]):
        self.assembler, self.fragments = assembler, fragments
        self._gathers = [assembler.subset(leaves) for leaves in fragments]
        self._dtypes = [[np.dtype(dtypes[i]) for i in leaves] for leaves in fragments]

    def blocks(self, full: list) -> list:
        """A leaf list, None outside the fragment (a pseudo-gradient as OuterSync exchanges it) ->
        this host's block of each leaf given, flat, read only when the exchange takes it."""
        return [None if leaf is None else HostBlock(leaf, *self.assembler.block(i)) for i, leaf in enumerate(full)]

    def gather(self, fragment: int, summed: list | None) -> list:
        """This host's summed blocks of `fragment`'s leaves, in the fragment's order (None if its
        exchange failed) -> the fragment's summed leaves on every device of the pod. Every host of
        the pod calls it at the same point (see the module's docstring); ExchangeError on every
        host if any host's exchange failed."""
        blocks = None if summed is None else [np.asarray(block) for block in summed]
        leaves, every_host = self._gathers[fragment](blocks, self._dtypes[fragment])
        if not every_host:
            raise ExchangeError(f"fragment {fragment}'s outer exchange failed on "
                                f"{'this host' if summed is None else 'another host of this pod'}: the outer step "
                                f"is not applied on any host")
        return leaves

    def zeros(self, fragment: int) -> list[np.ndarray]:
        """This host's blocks of `fragment`'s leaves as zeros, shaped as its exchange's sum (the
        configure-time warm-up gathers them: diloco_warmup.py)."""
        return [np.zeros(b - a, dtype) for (a, b), dtype in
                zip((self.assembler.block(i) for i in self.fragments[fragment]), self._dtypes[fragment])]

    def take_part(self, fragment: int) -> None:
        """The gather of a host whose exchange failed: it takes part, so that no other host of the
        pod waits in the collective alone; the other hosts learn of the failure there."""
        try:
            self.gather(fragment, None)
        except ExchangeError:
            pass
