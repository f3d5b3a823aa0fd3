"""How long a rank waits at a collective before it raises: one setting for every group megarl makes."""

import datetime
import os


def collective_timeout() -> datetime.timedelta:
    """MEGARL_COLLECTIVE_TIMEOUT_MINUTES (default 30), for gloo's and NCCL's groups and the shared-memory
    segments (`megarl.distributed.shared_memory`)."""
    return datetime.timedelta(minutes=float(os.environ.get("MEGARL_COLLECTIVE_TIMEOUT_MINUTES", "30")))
