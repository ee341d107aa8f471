"""The run's derived seeds and its prompt order (``ray_ppo.data.seeds``): the values runs and
checkpoints depend on, and the same prompt order in the synchronous loop and the coordinator."""

from ray_ppo.config import Config
from ray_ppo.coordinator.feed import PromptFeed
from ray_ppo.coordinator.ledger import PromptLedger
from ray_ppo.data.seeds import maker_seed, prompt_order, rank_seed
from ray_ppo.local import prompt_batches, run_local
from ray_ppo.tasks import toy


def test_ranks_and_makers_get_seeds_apart():
    assert [rank_seed(7, rank) for rank in range(3)] == [7, 8, 9]
    assert [maker_seed(7, maker_id) for maker_id in range(3)] == [1007, 2007, 3007]


def test_the_prompt_order_is_the_one_checkpoints_count_in():
    """A checkpoint's prompt-stream position is counted in this order: it must not change."""
    assert prompt_order(8, seed=3, epoch=0, shuffle=True).tolist() == [6, 7, 2, 1, 4, 5, 3, 0]
    assert prompt_order(8, seed=3, epoch=1, shuffle=True).tolist() == [1, 2, 0, 7, 4, 5, 3, 6]
    assert prompt_order(4, seed=3, epoch=5, shuffle=False).tolist() == [0, 1, 2, 3]


def coordinator_batches(prompts: list, batch_size: int, shuffle: bool, seed: int, n: int) -> list[list]:
    """The first ``n`` prompt batches the coordinator serves its makers."""
    feed = PromptFeed(lambda: prompts, PromptLedger(shuffle, seed))
    feed.load(feed.read())
    return [feed.next(maker_id=0, n=batch_size).prompts for _ in range(n)]


def test_prompt_batches_run_on_from_one_epoch_into_the_next_as_the_coordinator_serves_them():
    batches = prompt_batches(["a", "b", "c", "d", "e"], batch_size=2, shuffle=False, seed=0)
    assert [next(batches) for _ in range(4)] == [["a", "b"], ["c", "d"], ["e", "a"], ["b", "c"]]
    for shuffle in (False, True):
        batches = prompt_batches(list("abcdefg"), batch_size=3, shuffle=shuffle, seed=1)
        assert [next(batches) for _ in range(6)] == coordinator_batches(list("abcdefg"), 3, shuffle, seed=1, n=6)


def test_a_local_run_sees_the_prompts_the_coordinator_would_serve_in_the_same_order(monkeypatch):
    import ray_ppo.local

    seen = []

    class RecordingEncoder(ray_ppo.local.PromptEncoder):
        def encode(self, prompts):
            seen.append(list(prompts))
            return super().encode(prompts)

    monkeypatch.setattr(ray_ppo.local, "PromptEncoder", RecordingEncoder)
    prompts = toy.make_prompts(12, 4)
    cfg = Config().with_overrides({"seed": 5, "data.shuffle": True, "trainer.total_steps": 2, "maker.batch_size": 8,
                                   "trainer.train_batch_size": 8, "trainer.mini_batch_size": 8,
                                   "maker.max_new_tokens": 2})
    run_local(cfg, prompts=prompts)
    assert len(seen) == 2  # one batch a step, the second one across the epoch boundary
    assert seen == coordinator_batches(prompts, 8, shuffle=True, seed=5, n=2)
