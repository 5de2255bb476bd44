"""The run's policy choices as enums (str values, as TOML and --set spell them). Free of jax, so
the command line builds its flags' choices from them; run_config.py types its fields with them."""
from __future__ import annotations

import enum


class OnPodFailure(enum.StrEnum):
    """What a failed pod costs the run (docs/reliability.md)."""
    DEGRADE = "degrade"     # its shard goes to the survivors, bitwise as if nothing happened; it rejoins from a peer
    RESTORE = "restore"     # every pod goes back to the last checkpoint


class OnSpike(enum.StrEnum):
    """What a loss spike does (non-finite steps are always skipped, on every pod alike)."""
    NONE = "none"           # nothing: the run goes on
    REWIND = "rewind"       # restore the checkpoint before the spike and skip batches
