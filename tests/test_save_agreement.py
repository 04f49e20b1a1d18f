"""A pending background save agrees over the world at step boundaries 1, 2, 4, 8, ... then every 64, not
at every step (megapost.checkpoint.saver.poll); nothing at all when no save is pending."""

from __future__ import annotations

import threading

from megapost.checkpoint import saver


def test_agreement_due_at_powers_of_two_then_every_64() -> None:
    due = [n for n in range(1, 300) if saver.agreement_due(n)]
    assert due == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256]


def test_poll_agrees_only_when_due(monkeypatch) -> None:
    calls: list[int] = []
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    job = saver._Save("/nonexistent", "iter_0000002", 2, 0, 1, None, thread=thread)
    saving = saver.AsyncSaver()
    saving.pending = job
    monkeypatch.setattr(saving, "_published", lambda _job: calls.append(-1))

    def agree(j: saver._Save, done: bool) -> bool:
        calls.append(j.boundaries)
        return done

    monkeypatch.setattr(saving, "_agree", agree)
    try:
        for _ in range(7):  # boundaries 1..7 while the write runs: agreements at 1, 2, 4
            saving.poll()
        assert calls == [1, 2, 4]
        release.set()
        thread.join()
        saving.poll()  # boundary 8: due, the write is done: published
        assert calls == [1, 2, 4, 8, -1] and saving.pending is None
        saving.poll()  # nothing pending: nothing
        assert calls == [1, 2, 4, 8, -1]
    finally:
        release.set()
