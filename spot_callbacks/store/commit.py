"""The commit protocol, in one place: what makes a checkpoint committed, and what retention may delete.

(Being filled in: the rest of the protocol moves here from the store facade.)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spot_callbacks.store import CheckpointInfo, CheckpointStore

log = logging.getLogger("spot_callbacks")


def settle_commit(
    store: CheckpointStore, info: CheckpointInfo, keep_last: int, deadline: float | None
) -> None:
    """What follows a commit: a late emergency is said, and retention runs unless it was an emergency.

    An emergency checkpoint (one with a ``deadline``) spends none of its seconds on deletes:
    retention waits for the next commit (the next run's first). Retention failing never fails
    the commit; it is retried after the next one.
    """
    if deadline is not None:
        if time.time() > deadline:
            log.warning(
                "spot_callbacks: the emergency checkpoint of step %d committed %.1fs after its deadline",
                info.step, time.time() - deadline,
            )  # fmt: skip
        return
    try:
        store.prune(keep_last)
    except Exception as err:  # noqa: BLE001 - retention failing must not fail the commit
        log.warning(
            "spot_callbacks: retention in %s failed, will retry after the next commit: %s", store.url, err
        )
