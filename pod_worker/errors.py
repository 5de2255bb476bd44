"""The typed refusals of a pod (pod.py, sequencer.py). They carry no transport: the gRPC adapter
(server.py) maps each type to one status code, so the caller never has to parse a message.

    InvalidRequest     INVALID_ARGUMENT     the request is wrong whatever the pod's state
    NotReady           FAILED_PRECONDITION  the pod is not in a state to do it now
      Busy                                  something else runs (a step, a restore, ...) and did not
                                            finish within the request's deadline
      AlreadyDone                           the step was already done
      SavePending                           the checkpoint is still being written
    StepAborted        ABORTED              the step cannot run on this timeline (an earlier step failed
                                            or did not finish in time; the pod was reconfigured/restored)
    Cancelled          CANCELLED            the caller went away while the step waited
    CorruptCheckpoint  DATA_LOSS            the arrays read back are not the ones written
      CorruptTransfer                       a peer's state arrived, but not the state it hashed
    SaveNotFound       NOT_FOUND            no such save was started on this pod
"""
from __future__ import annotations


class PodError(Exception):
    """A request the pod refuses; the type says why."""


class InvalidRequest(PodError):
    """The request itself is wrong."""


class NotReady(PodError):
    """The pod cannot do this in its current state."""


class Busy(NotReady):
    """Another step or hold kept the pod busy past the request's deadline."""


class AlreadyDone(NotReady):
    """The requested step is behind the pod."""


class SavePending(NotReady):
    """The checkpoint is still being written."""


class StepAborted(PodError):
    """The step belongs to a timeline the pod has left or cannot continue."""


class Cancelled(PodError):
    """The caller cancelled the request while it waited."""


class CorruptCheckpoint(PodError):
    """The checkpoint's arrays do not match the fingerprint saved with them."""


class CorruptTransfer(CorruptCheckpoint):
    """A state transfer delivered arrays whose fingerprint is not the donor's."""


class SaveNotFound(PodError):
    """No save of that step in that directory was started on this pod."""
