"""``ray_ppo.cluster.sweep.sweep`` up to the point where it hands Tune its trials (on the local cluster it
starts, which runs no trial): what Tune is given (the trials themselves run in tests/e2e and tests/ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray import tune
from ray.tune.experiment import Experiment

from ray_ppo.cluster.sweep import sweep
from ray_ppo.config import load_config

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
pytestmark = pytest.mark.usefixtures("tiny_path")


class Handed(Exception):
    """Raised by the stand-in ``Tuner`` once it has what ``sweep`` gave it."""


def handed_to_tune(monkeypatch, tmp_path, seed: int, space: dict, num_samples: int, max_concurrent: int):
    """The ``TuneConfig`` that ``sweep`` builds for a config at ``seed`` (the stand-in Tuner ends it there)."""
    handed = []

    def tuner(trainable, param_space, tune_config, run_config):
        handed.append(tune_config)
        raise Handed

    monkeypatch.setattr(tune, "Tuner", tuner)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})  # room for 6 trials of tiny.yaml
    cfg = load_config(TINY, [f"seed={seed}", f"logging.output_dir={tmp_path / 'run'}"])
    with pytest.raises(Handed):
        sweep(cfg, space, num_samples=num_samples, max_concurrent_trials=max_concurrent,
              output_dir=str(tmp_path / "sweep"))
    return handed[0]


def sampled(tune_config, space: dict, num_samples: int) -> list[dict]:
    """The trial configs Tune's search algorithm hands out, as long as it hands any."""
    search = tune_config.search_alg
    search.add_configurations([Experiment("sampled", run=lambda config: None, config=space, num_samples=num_samples)])
    trials = []
    while (trial := search.next_trial()) is not None:
        trials.append(trial.config)
    return trials


def test_a_sweeps_random_sampling_is_seeded_by_the_configs_seed(monkeypatch, tmp_path):
    """The same command samples the same settings (``ray-ppo tune --async-search`` samples a few of
    its 81); another seed, others. Before, Tune's generator was unseeded: two runs of one search
    tried different settings."""
    space = {"ppo.kl_coef": tune.choice([0.001 * i for i in range(1, 50)]), "maker.batch_size": tune.choice([8, 16, 32])}
    runs = [sampled(handed_to_tune(monkeypatch, tmp_path, seed, space, 6, 6), space, 6) for seed in (0, 0, 1)]
    assert len(runs[0]) == 6
    assert runs[0] == runs[1] != runs[2]


def test_the_seeded_generator_keeps_the_concurrency_limit(monkeypatch, tmp_path):
    """Tune ignores ``TuneConfig.max_concurrent_trials`` when given a generator of its own, so the
    generator holds the limit: with 2 allowed, it hands out 2 trials until one ends."""
    space = {"ppo.kl_coef": tune.choice([0.01, 0.02, 0.05])}
    tune_config = handed_to_tune(monkeypatch, tmp_path, 0, space, 5, 2)
    assert tune_config.max_concurrent_trials is None
    assert len(sampled(tune_config, space, 5)) == 2


def test_a_trial_line_shows_the_keys_a_preset_sets():
    """The async search's confirmation sweeps the seed and a preset of four keys: each ended trial's
    line names them, as a grid's line names its keys (not the preset as one dict)."""
    import io
    from types import SimpleNamespace

    from ray_ppo.cluster.sweep import PRESET_KEY, trial_lines

    stream = io.StringIO()
    lines = trial_lines(["seed", PRESET_KEY], "reward_mean", stream=stream, total=2)
    trial = SimpleNamespace(config={"seed": 1, PRESET_KEY: {"maker.num_makers": 1, "maker.batch_size": 16}},
                            last_result={"reward_mean": 0.5, "step": 3, "time_total_s": 12.2})
    lines.on_trial_complete(0, [trial], trial)
    assert stream.getvalue() == "trial 1/2 done: seed=1, num_makers=1, batch_size=16 | reward_mean 0.5000 at step 3 | 12 s\n"
