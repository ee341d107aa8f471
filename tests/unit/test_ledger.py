"""Unit tests of ray_ppo.coordinator.ledger.PromptLedger: exactly-once prompts by identity (no Ray)."""

from __future__ import annotations

import json
import random

import pytest

from ray_ppo.coordinator.ledger import LedgerError, PromptLedger


def ledger(n: int = 10, start: dict | None = None, shuffle: bool = False, seed: int = 0) -> PromptLedger:
    led = PromptLedger(shuffle=shuffle, seed=seed, start=start)
    led.configure(n)
    return led


def test_prompt_ids_name_rows_and_every_epoch_serves_each_row_once():
    led = ledger(8, shuffle=True, seed=3)
    ids = led.take(20, maker_id=0)  # two and a half epochs
    assert sorted(led.row(i) for i in ids[:8]) == list(range(8)) == sorted(led.row(i) for i in ids[8:16])
    assert [i // 8 for i in ids] == [0] * 8 + [1] * 8 + [2] * 4  # id = epoch * N + row
    assert ids[:8] != ids[8:16] and [led.serial(i) for i in ids] == list(range(20))
    assert ledger(8, shuffle=True, seed=3).take(20, 0) == ids  # a function of (N, shuffle, seed) alone
    assert ledger(5).take(5, 0) == [0, 1, 2, 3, 4]  # no shuffle: file order


def test_a_prompt_is_trained_once_all_its_items_are_pulled_and_blank_ones_are_done():
    led = ledger(4)
    assert led.take(4, maker_id=1) == [0, 1, 2, 3]
    led.returned(1, [0, 1, 2, 3], [0, 0, 1, 1, 3, 3])  # two samples per prompt; prompt 2 was blank
    assert led.consumed([0, 1], step=1) == 0 and led.consumed([0, 1], step=2) == 2  # a group split over steps
    assert led.consumed([3, 3], step=2) == 1
    assert led.log == {2: [0, 1, 3]} and led.counts["blank"] == 1 and led.trained_by() == 3
    assert led.watermark == 4 and led.done == set()


def test_a_group_dynamic_sampling_dropped_is_done_and_counted_apart_from_blank_ones():
    led = ledger(4)
    led.take(4, maker_id=0)
    led.returned(0, [0, 1, 2, 3], [1, 1, 3, 3], dropped=[2])  # 0 blank, 2 dropped (rewards all equal)
    assert (led.counts["blank"], led.counts["dropped"]) == (1, 1)
    assert led.consumed([1, 1, 3, 3], step=1) == 2 and led.watermark == 4  # every prompt done: none served again
    resumed = ledger(4, start=led.state(1))
    assert resumed.counts["dropped"] == 1 and resumed.take(1, 0) == [4]


def test_discarded_and_lost_prompts_are_served_again_first():
    led = ledger(10)
    assert led.take(3, maker_id=0) == [0, 1, 2] and led.take(3, maker_id=1) == [3, 4, 5]
    led.returned(0, [0, 1, 2], [0, 1, 2])
    assert led.requeue([1, 1]) == 1  # discarded as stale: its items are gone
    assert led.maker_lost(1) == 3    # maker 1 died holding 3, 4, 5
    assert led.take(5, maker_id=0) == [1, 3, 4, 5, 6]
    assert led.counts["requeued"] == 4 and led.counts["lost"] == 3


def test_a_checkpoint_counts_only_prompts_trained_by_its_step():
    led = ledger(10)
    led.take(6, 0)
    led.returned(0, list(range(6)), [0, 1, 2, 3, 4, 5])
    led.consumed([0, 2], step=1)
    led.consumed([1, 5], step=2)  # trained after the checkpoint of step 1
    state = json.loads(json.dumps(led.state(step=1)))  # it goes through state.json
    assert (state["watermark"], state["next"], state["done"]) == (1, 6, [2])
    assert state["trained"] == [[1, [0, 2]]]
    resumed = ledger(10, start=state)
    assert resumed.take(5, maker_id=0) == [1, 3, 4, 5, 6]  # not done at step 1 (in flight included), then new


def test_trained_by_counts_the_prompts_of_a_step_and_not_those_pulled_ahead_for_the_next():
    """A rank pulls step s + 1's items while step s trains (``trainer.prefetch``): step s's row
    counts the prompts trained at steps up to s, not those pulled ahead."""
    led = ledger(10)
    led.take(6, 0)
    led.returned(0, list(range(6)), [0, 1, 2, 3, 4, 5])
    led.consumed([0, 1], step=1)
    led.consumed([2, 3], step=2)  # pulled ahead while step 1 trained
    assert (led.trained_by(1), led.trained_by(2), led.trained_by()) == (2, 4, 4)
    led.unconsumed([2, 3])  # step 1 was the last: the pull ahead is handed back
    assert (led.trained_by(1), led.trained_by(2)) == (2, 2)
    led.consumed([2, 3, 4], step=2)
    led.requeue([4])  # lost in transit: not trained after all
    assert (led.trained_by(1), led.trained_by(2)) == (2, 4)


def test_a_resumed_ledger_counts_the_whole_run():
    """The counts go into the checkpoint: a resumed run's counts go on from the checkpoint's, and
    its prompts trained count those trained up to the checkpoint's step (later ones are redone)."""
    led = ledger(10)
    led.take(4, 0)
    led.take(4, 1)
    led.returned(0, [0, 1, 2, 3], [0, 1, 3], truncated=1)  # prompt 2 was blank
    led.consumed([0, 1], step=1)
    led.consumed([3], step=2)  # trained after the checkpoint of step 1: trained again after the resume
    led.maker_lost(1)  # maker 1 died holding 4, 5, 6, 7
    counts = {"taken": 8, "blank": 1, "dropped": 0, "truncated": 1, "lost": 4, "requeued": 4}
    assert led.counts == counts and led.trained_by() == 3
    state = json.loads(json.dumps(led.state(step=1)))
    assert state["counts"] == {**counts, "trained": 2}
    resumed = PromptLedger(start=state)
    assert resumed.counts == counts and resumed.trained_by(1) == 2  # before the prompts are loaded
    resumed.configure(10)
    ids = resumed.take(3, 0)
    assert ids == [3, 4, 5]  # not done at step 1 (3 was trained at step 2), then the lost ones
    resumed.returned(0, ids, ids)
    resumed.consumed(ids, step=2)
    assert (resumed.trained_by(1), resumed.trained_by(2), resumed.counts["taken"]) == (2, 5, 11)


def test_rewind_serves_again_what_a_lost_worker_group_trained():
    led = ledger(4)
    led.take(4, 0)
    led.returned(0, [0, 1, 2, 3], [0, 1, 2, 3])
    led.consumed([0, 1], step=1)
    led.consumed([2, 3], step=2)
    assert led.watermark == 4
    assert led.rewind(1) == 2  # restarted from the checkpoint of step 1
    assert led.watermark == 2 and led.log == {1: [0, 1]} and led.trained_by() == 2
    assert led.take(3, 0) == [2, 3, 4]


def test_a_lost_in_transit_item_undoes_its_prompts_training():
    led = ledger(4)
    led.take(2, 0)
    led.returned(0, [0, 1], [0, 1])
    led.consumed([0, 1], step=1)
    assert led.requeue([1]) == 1  # the rank found the payload gone: it did not train on it
    assert led.log == {1: [0]} and led.watermark == 1 and led.take(1, 0) == [1]


def test_resume_state_must_fit_the_data():
    state = ledger(10).state()
    with pytest.raises(LedgerError, match="has 10 prompts, the prompt data now has 12"):
        ledger(12, start=state)
    with pytest.raises(LedgerError, match="empty"):
        PromptLedger().configure(0)
    old = ledger(10, start={"epoch": 1, "position": 4})  # checkpoints made before prompt ids
    assert old.take(1, 0) == [14]


@pytest.mark.parametrize("seed", range(6))
def test_exactly_once_across_random_crashes_with_three_makers(seed):
    """Three makers finish batches out of order, items go stale, a maker dies, and the run is
    'killed' at random moments and resumed from its last checkpoint: over the lineage of the
    final checkpoint, every prompt of the first epochs is trained exactly once."""
    rng = random.Random(seed)
    n, batch, per_step, checkpoint_every, total_steps = 23, 4, 6, 2, 16
    led, step, checkpoint = ledger(n, shuffle=True, seed=seed), 0, None
    held: dict[int, list[int]] = {}  # maker -> ids it is generating
    buffer: list[int] = []           # item prompt ids in the coordinator, in arrival order
    while step < total_steps:
        event = rng.random()
        maker = rng.randrange(3)
        if event < 0.3 and maker not in held:
            held[maker] = led.take(batch, maker)
        elif event < 0.6 and maker in held:
            ids = held.pop(maker)
            items = [i for i in ids if not blank(i) for _ in range(2)]  # 2 samples per prompt
            led.returned(maker, ids, items)
            buffer += items
        elif event < 0.65 and buffer:
            stale, buffer = buffer[:2], buffer[2:]
            led.requeue(stale)
        elif event < 0.67 and maker in held:
            held.pop(maker)
            led.maker_lost(maker)
        elif event < 0.9 and len(buffer) >= per_step:
            step += 1
            pulled, buffer = buffer[:per_step], buffer[per_step:]
            led.consumed(pulled, step)
            if step % checkpoint_every == 0:
                checkpoint = json.loads(json.dumps(led.state(step)))
        elif event >= 0.97 and checkpoint is not None:  # the driver is killed: resume
            led, held, buffer = ledger(n, start=checkpoint, shuffle=True, seed=seed), {}, []
            step = max(s for s, _ in checkpoint["trained"]) if checkpoint["trained"] else 0
    trained = [pid for _, ids in led.state(step)["trained"] for pid in ids]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert not any(blank(pid) for pid in trained)
    complete = led.watermark // n
    assert complete >= 1
    for epoch in range(max(complete - 1, 0), complete):  # the complete epochs the log still holds
        expected = {pid for pid in range(epoch * n, (epoch + 1) * n) if not blank(pid)}
        assert expected <= set(trained), f"epoch {epoch}: never trained {sorted(expected - set(trained))}"


def blank(prompt_id: int) -> bool:
    """Which prompts of the simulated data are blank (a property of the row, as for real text)."""
    return prompt_id % 23 % 7 == 3


def test_a_resumed_stream_keeps_its_order_whatever_the_config_says_now():
    led = ledger(10, shuffle=True, seed=5)
    first = led.take(4, 0)
    state = led.state()
    resumed = ledger(10, start=state, shuffle=False, seed=0)  # e.g. data.shuffle changed on resume
    assert resumed.take(10, 0) == first + ledger(10, shuffle=True, seed=5).take(10, 0)[4:10]
