"""A critic-free estimator with groups on the detached pipeline: 2 makers : 2 ranks, GRPO with 4
responses per prompt, decoupled off-policy correction, stale experience allowed."""

from pathlib import Path

import pytest

from ray_ppo.api import PPOTrainer
from ray_ppo.config import load_config
from ray_ppo.train.checkpoint import load_trainer_state

pytestmark = pytest.mark.ray

REPO = Path(__file__).parents[2]
STEPS, BATCH, GROUP = 3, 16, 4


def test_grpo_groups_without_a_critic(ray_session, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"trainer.total_steps={STEPS}", f"trainer.train_batch_size={BATCH}", "trainer.mini_batch_size=8",
        "trainer.num_workers=2", "maker.num_makers=2", "maker.batch_size=2", f"maker.samples_per_prompt={GROUP}",
        "algo.advantage=grpo", "ppo.off_policy=decoupled", "ppo.max_staleness=2", f"logging.output_dir={tmp_path}",
        "trainer.pull_timeout_s=60", "logging.report_every=1"])
    trainer = PPOTrainer(cfg)
    result = trainer.fit()

    history = trainer.history
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    last = history[-1]
    assert "value_loss" not in last and "explained_variance" not in last
    for key in ("is_weight_mean", "is_weight_max", "is_capped_frac", "behaviour_kl"):
        assert key in last, key
    assert any(k.startswith("behaviour_kl_stale_") for k in last)
    assert last["weights_in_sync"] == 1.0  # makers hold exactly the pushed actor (no critic pushed)
    counters = trainer.final_status.counters
    assert counters.consumed == STEPS * BATCH * 2
    with result.checkpoint.as_directory() as directory:
        assert not (Path(directory) / "critic").exists()
        actor, critic, optim, state = load_trainer_state(directory)
        assert critic is None and "critic" not in optim and state.has_critic is False
