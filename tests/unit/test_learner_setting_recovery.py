"""``experiments/studies/learner_setting.py --recovery``: warm-up's recovery paths as stored, left out, or
learning their recovery action alone (pure logic over stored records)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.studies.learner_setting import recovery_demos  # noqa: E402

MAIN = {"id": "a:e1", "turns": [["go to desk 1", "..."], ["take pen 1 from desk 1", "..."]], "targets": [True, True]}
RECOVERY = {
    "id": "a:e1:1:r",
    "recovery": True,
    "turns": [["go to desk 1", "..."], ["look", "..."], ["take pen 1 from desk 1", "..."]],
    "targets": [True, False, True],
}
STEP = {"id": "a:e2:0:r", "recovery": True, "s": "Task: ...", "target": "go to desk 1"}  # the window form's


def test_stored_keeps_every_record_as_it_came():
    records = [MAIN, RECOVERY, STEP]
    assert recovery_demos(records, "stored") == records


def test_none_leaves_out_every_recovery_demonstration():
    assert recovery_demos([MAIN, RECOVERY, STEP], "none") == [MAIN]


def test_last_keeps_a_loss_on_the_recovery_action_alone_and_copies_the_record():
    out = recovery_demos([MAIN, RECOVERY, STEP], "last")
    assert out[0] == MAIN and out[2] == STEP
    assert out[1]["targets"] == [False, False, True] and out[1]["turns"] == RECOVERY["turns"]
    assert RECOVERY["targets"] == [True, False, True]  # the stored record is not changed
