"""A submission's leases: the heartbeat keeps them alive and releases them; the wait for trials
that another submission holds ends when they settle, or when a holder's lease lapses."""

import threading
import time

from orchestrator.execution.leases import Heartbeat, owner_id, wait_for_holders
from orchestrator.records.ledger import Ledger, Status
from tests.orchestrator.test_ledger import COORDS
from workloads.core.trial import Trial


def _trial(trial_id: str) -> Trial:
    return Trial(trial_id, "language_model", "d", "v", "s", 0.01, 0, None, None, None, None,
                 None, None, None, None, 1, 1)


def _ledger(tmp_path, n: int) -> tuple[Ledger, int, list[int]]:
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    exp = ledger.ensure_experiment("leases", "language_model", "")
    return ledger, exp.id, [ledger.ensure_trial(exp.id, f"t{i}", **COORDS).id for i in range(n)]


def test_owner_ids_are_unique_and_name_the_host_and_process():
    import os
    import socket

    a, b = owner_id(), owner_id()
    assert a != b and a.startswith(f"{socket.gethostname()}:{os.getpid()}:")


def test_the_heartbeat_keeps_leases_alive_past_their_life_and_releases_them(tmp_path):
    ledger, exp_id, (row,) = _ledger(tmp_path, 1)
    with Heartbeat(ledger, "me", lease_s=0.4):
        assert ledger.acquire(row, "me", lease_s=0.4).acquired
        time.sleep(1.2)  # three lease lives: only the heartbeat keeps it
        assert not ledger.acquire(row, "other", lease_s=0.4).acquired
    assert ledger.trials(exp_id)[0].lease_owner is None  # released on exit
    assert ledger.acquire(row, "other", lease_s=0.4).acquired


def test_waiting_ends_when_the_held_trials_settle(tmp_path):
    ledger, exp_id, rows = _ledger(tmp_path, 2)
    for row in rows:
        assert ledger.acquire(row, "other", lease_s=60).acquired

    def settle():
        time.sleep(0.3)
        ledger.update_trial(rows[0], status=Status.FINISHED)
        ledger.update_trial(rows[1], status=Status.FAILED)  # not retried by the waiter

    threading.Thread(target=settle).start()
    started = time.monotonic()
    assert wait_for_holders(ledger, exp_id, [_trial("t0"), _trial("t1")], poll_s=0.05) == []
    assert 0.3 <= time.monotonic() - started < 5


def test_waiting_hands_back_the_open_trials_once_a_holder_lapses(tmp_path, capsys):
    ledger, exp_id, rows = _ledger(tmp_path, 3)
    started = time.monotonic()  # the dead holder's 0.3 s lease runs from here
    ledger.acquire(rows[0], "dead", lease_s=0.3)
    ledger.acquire(rows[1], "alive", lease_s=60)
    ledger.acquire(rows[2], "alive", lease_s=60)
    ledger.update_trial(rows[2], status=Status.FINISHED)
    held = [_trial("t0"), _trial("t1"), _trial("t2")]
    again = wait_for_holders(ledger, exp_id, held, poll_s=0.05)
    assert [t.trial_id for t in again] == ["t0", "t1"]  # t1 is claimed again, and found held
    assert 0.25 <= time.monotonic() - started < 5
    assert "waiting for 3 trial(s) that another submission holds" in capsys.readouterr().out


def test_waiting_for_a_trial_held_in_another_experiment_ends_when_it_finishes_there(tmp_path):
    ledger, exp_id, (row,) = _ledger(tmp_path, 1)
    other = ledger.ensure_experiment("elsewhere", "language_model", "")
    there = ledger.ensure_trial(other.id, "t0", **COORDS)
    assert ledger.acquire(there.id, "other", lease_s=60).acquired
    assert not ledger.acquire(row, "me", lease_s=60).acquired

    def finish_there():
        time.sleep(0.3)
        ledger.update_trial(there.id, owner="other", status=Status.FINISHED)

    threading.Thread(target=finish_there).start()
    started = time.monotonic()
    # handed back to be claimed (and copied), though its own row here is still open
    assert [t.trial_id for t in wait_for_holders(ledger, exp_id, [_trial("t0")],
                                                 poll_s=0.05)] == ["t0"]
    assert 0.3 <= time.monotonic() - started < 5
