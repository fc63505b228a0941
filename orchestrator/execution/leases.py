"""A submission's hold on the trials it trains (``Ledger.acquire``): its owner id, the heartbeat
that keeps its leases alive while it runs, and the wait for trials that another submission
holds (until they settle, or until a lease expires and the trial can be taken over)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from types import TracebackType

from orchestrator.records.ledger import Ledger, Status, utc_now
from workloads.core.trial import Trial

log = logging.getLogger(__name__)

SETTLED = (Status.FINISHED, Status.FAILED)


def owner_id() -> str:
    """This submission's lease owner id: ``<host>:<pid>:<random>`` (unique even when a pid is
    reused, readable in logs and in the ledger)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Heartbeat:
    """While the ``with`` block runs, renew every lease of ``owner`` each ``lease_s / 4``
    seconds (a ledger that does not answer is retried at the next beat, with a warning); on
    exit, release the leases ``owner`` still holds (best effort: a lease left behind lapses)."""

    def __init__(self, ledger: Ledger, owner: str, lease_s: float) -> None:
        self.ledger, self.owner, self.lease_s = ledger, owner, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="cemlab-lease-heartbeat",
                                        daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self.ledger.renew(self.owner, self.lease_s)
            except Exception as e:  # a ledger outage: the lease lives on until it expires
                log.warning("lease heartbeat of %s failed (%s): retrying in %.0f s", self.owner,
                            str(e).splitlines()[0], self.lease_s / 4)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.ledger.release(self.owner)
        except Exception as e:  # best effort: unreleased leases lapse on their own
            log.warning("could not release the leases of %s (%s): they lapse within %.0f s",
                        self.owner, str(e).splitlines()[0], self.lease_s)


def wait_for_holders(ledger: Ledger, experiment_row_id: int, held: list[Trial],
                     poll_s: float) -> list[Trial]:
    """Wait while other submissions train ``held`` (in this experiment or, for a trial id that
    another experiment shares, in that one): returns [] once every one of them has settled
    here (FINISHED or FAILED), or, as soon as one of them is held by no live lease in any
    experiment (its holder finished it there, or died), the ones still unsettled here, to be
    claimed again."""
    if not held:
        return []
    by_id = {t.trial_id: t for t in held}
    print(f"[cemlab] waiting for {len(held)} trial(s) that another submission holds",
          flush=True)
    while True:
        rows = ledger.rows_of_trials(set(by_id))
        open_ids = {r.trial_hash for r in rows
                    if r.experiment_id == experiment_row_id and r.status not in SETTLED}
        if not open_ids:
            return []
        now = utc_now()
        live = {r.trial_hash for r in rows
                if r.lease_expires_at is not None and r.lease_expires_at > now}
        if open_ids - live:
            return [by_id[h] for h in sorted(open_ids)]
        time.sleep(poll_s)
