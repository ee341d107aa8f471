"""What a run shows: prompt/item counts in the live line and summary, samples in samples.jsonl and
TensorBoard text, the same run files from the CLI, the local loop and PPOTrainer, ``ray-ppo config``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from ray_ppo.algo import ExperienceItem
from ray_ppo.cli import _summary, main
from ray_ppo.config import Config, _schema
from ray_ppo.outputs.samples import SAMPLES_KEY, pick_samples, samples_due
from ray_ppo.outputs.tracking import LiveLine, RunDirectory, counts_summary, read_metrics

ROOT = Path(__file__).parents[2]
ROW = {"step": 4, "reward_mean": 0.5, "kl": 0.01, "policy_version": 4, "prompts_served": 96.0,
       "prompts_blank": 2.0, "prompts_truncated": 3.0, "prompts_lost": 0.0, "items_discarded": 16.0}


def test_live_line_shows_nonzero_counts():
    stream = io.StringIO()
    LiveLine(total_steps=8, stream=stream)(ROW)
    assert stream.getvalue() == "step 4/8 | reward 0.500 | kl 0.0100 | v 4 | blank 2, truncated 3, discarded 16\n"
    stream = io.StringIO()
    LiveLine(total_steps=8, stream=stream)({**ROW, "prompts_blank": 0.0, "prompts_truncated": 0.0, "items_discarded": 0.0})
    assert stream.getvalue() == "step 4/8 | reward 0.500 | kl 0.0100 | v 4\n"


def test_summary_counts_prompts_and_items(tmp_path):
    assert counts_summary([ROW]) == "96 prompts: 2 blank, 3 truncated, 0 lost; 16 items discarded"
    line = _summary([{**ROW, "samples_per_s": 10.0}], 12.0, tmp_path)
    assert line == (f"done: 1 steps in 12 s | reward 0.500 (first 10%) -> 0.500 (last 10%) | 10.0 samples/s | "
                    f"96 prompts: 2 blank, 3 truncated, 0 lost; 16 items discarded | run dir {tmp_path}")
    assert counts_summary([{"step": 1}]) == ""  # the local loop has no coordinator counters


FAULT = "step raised RuntimeError: the environment broke (env.cls='e:E', prompt '0 9 4')"


def test_the_live_line_says_how_many_faults_it_does_not_show():
    samples = [{"step": 4, "prompt": "0 9 4", "response": "1", "reward": 0.0, "policy_version": 3, "uid": f"u{i}",
                "fault": FAULT} for i in range(4)]
    stream = io.StringIO()
    LiveLine(total_steps=8, stream=stream)({"step": 4, "reward_mean": 0.5, "env/fault": 0.1875, "fault_count": 12.0,
                                            SAMPLES_KEY: samples})
    assert stream.getvalue().splitlines()[1:] == [f"  episode ended on an environment fault: {FAULT}"] * 4 + [
        "  ... and 8 more environment faults this step (env/fault 0.19)"]
    stream = io.StringIO()
    LiveLine(total_steps=8, stream=stream)({"step": 4, "reward_mean": 0.5, "env/fault": 0.0625, "fault_count": 4.0,
                                            SAMPLES_KEY: samples})
    assert len(stream.getvalue().splitlines()) == 5  # every fault shown: nothing more to say


def test_the_summary_counts_the_runs_faulted_episodes(tmp_path):
    rows = [{**ROW, "step": s, "samples_per_s": 10.0, "fault_count": float(s % 2)} for s in range(1, 6)]
    assert counts_summary(rows) == ("96 prompts: 2 blank, 3 truncated, 0 lost; 16 items discarded; "
                                    "3 episodes ended on an environment fault")
    assert counts_summary([{"step": 1, "fault_count": 2.0}]) == "2 episodes ended on an environment fault"  # local
    assert counts_summary([{**ROW, "fault_count": 0.0}]).endswith("16 items discarded")


def test_the_summary_of_a_resumed_run_covers_the_whole_run_and_says_what_this_process_trained(tmp_path):
    """metrics.jsonl holds the earlier process's steps 1-4 and this one's 5-6; the history, this one's."""
    rows = [{**ROW, "step": s, "reward_mean": 0.1 * s, "samples_per_s": float(s), "prompts_served": 16.0 * s}
            for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = _summary(rows[4:], 20.0, tmp_path)
    assert line == (f"done: 6 steps (steps 5-6 in this process, 2 steps) in 20 s | reward 0.100 (first 10%) -> "
                    f"0.600 (last 10%) | 3.5 samples/s | 96 prompts: 2 blank, 3 truncated, 0 lost; "
                    f"16 items discarded | run dir {tmp_path}")
    assert _summary(rows, 20.0, tmp_path).startswith("done: 6 steps in 20 s | reward 0.100 (first 10%)")


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not skip_special_tokens or i > 2)


def _item(prompt, response, reward, uid):
    t = torch.zeros(len(response))
    return ExperienceItem(torch.tensor(prompt), torch.tensor(response), t, t, t, t, t, t, reward, 3, uid)


def test_samples_are_picked_every_n_steps():
    assert [s for s in range(1, 11) if samples_due(s, 5)] == [5, 10]
    assert not any(samples_due(s, 0) for s in range(1, 11))
    items = [_item([5, 6], [7, 1], 0.25, f"m-0-{i}") for i in range(6)]
    samples = pick_samples(items, _Tokenizer(), step=5)
    assert len(samples) == 4
    assert samples[0] == {"step": 5, "prompt": "5 6", "response": "7", "reward": 0.25, "policy_version": 3,
                          "uid": "m-0-0"}


def test_samples_write_a_float32_reward_as_its_shortest_decimal():
    items = [_item([5, 6], [7, 1], float(torch.tensor(reward)), f"m-0-{i}") for i, reward in enumerate((0.3, 1 / 3))]
    assert float(torch.tensor(0.3)) == 0.30000001192092896  # the float32 score, widened
    samples = pick_samples(items, _Tokenizer(), step=5)
    assert [json.dumps(s["reward"]) for s in samples] == ["0.3", "0.33333334"]
    assert [torch.tensor(s["reward"]).item() for s in samples] == [it.reward for it in items]  # the same float32


def test_run_directory_writes_samples_apart_from_metrics(tmp_path):
    cfg = Config().with_overrides({"logging.tensorboard": True})
    run = RunDirectory(tmp_path, cfg, tensorboard=True)
    run({"step": 1, "reward_mean": 0.1})
    assert not (tmp_path / "samples.jsonl").exists()
    samples = [{"step": 2, "prompt": "1 2 | 3", "response": "3 3", "reward": 0.5, "policy_version": 2, "uid": "a"}]
    run({"step": 2, "reward_mean": 0.2, SAMPLES_KEY: samples})
    run.close()
    assert [set(r) for r in read_metrics(tmp_path / "metrics.jsonl")] == [{"step", "reward_mean"}] * 2
    assert [json.loads(line) for line in open(tmp_path / "samples.jsonl")] == samples

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 2
    markdown = text.tensor_proto.string_val[0].decode()
    assert "| 1 2 \\| 3 | 3 3 | 0.500 |" in markdown


def test_local_run_writes_samples(tmp_path, monkeypatch, tiny_path, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    assert main(["local", "--config", "configs/tiny.yaml", "--output", str(out), "trainer.total_steps=2",
                 "trainer.train_batch_size=8", "trainer.mini_batch_size=4", "maker.batch_size=8",
                 "logging.samples_every=2", "logging.progress=false"]) == 0
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert [s["step"] for s in samples] == [2] * 4
    assert all(isinstance(s["prompt"], str) and isinstance(s["response"], str) and 0 <= s["reward"] <= 1
               for s in samples)
    assert all(SAMPLES_KEY not in row for row in read_metrics(out / "metrics.jsonl"))
    assert (out / "curves.png").exists() and (out / "config.yaml").exists()


def test_config_command_lists_every_key_with_doc_and_default(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["config", "--config", "configs/tiny.yaml", "ppo.kl_coef=0.3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    settings = [k for k, hint in _schema().items() if not hasattr(hint, "model_fields")]
    for key in settings:
        (index,) = [i for i, line in enumerate(lines) if line.startswith(f"{key} = ")]
        assert lines[index + 1].startswith("    ") and lines[index + 1].strip(), key  # its doc
    assert "ppo.kl_coef = 0.3   (default: 0.05)" in lines
    assert "ppo.eps_clip = 0.2   (default)" in lines
    assert "logging.samples_every = 10   (default)" in lines
    assert any(line.startswith("[ppo]  ") for line in lines)
