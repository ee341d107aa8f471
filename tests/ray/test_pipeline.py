"""The detached pipeline end to end on a local CPU cluster: fit() with M makers : N ranks."""

import csv
import json
import re
from pathlib import Path

import pytest
import ray

from ray_ppo.api import PPOTrainer
from ray_ppo.config import load_config
from ray_ppo.config.preflight import PreflightError
from ray_ppo.data import DataError, read_texts
from ray_ppo.outputs.failures import ERROR_LOG, one_line, report_failure
from ray_ppo.tasks.toy import make_prompts

pytestmark = pytest.mark.ray

REPO = Path(__file__).parents[2]
STEPS = 4
BATCH = 16
MAX_STALENESS = 1


def small_config(tmp_path, *overrides):
    return load_config(REPO / "configs" / "tiny.yaml", [
        f"trainer.total_steps={STEPS}", f"trainer.train_batch_size={BATCH}", "trainer.mini_batch_size=8",
        "maker.batch_size=8", f"ppo.max_staleness={MAX_STALENESS}", f"logging.output_dir={tmp_path}",
        "trainer.pull_timeout_s=60", "logging.report_every=2", *overrides])


def messy_prompts(path: Path) -> Path:
    """The toy prompts plus blank ones and prompts longer than data.max_prompt_len (16 tokens)."""
    rows = [line.strip() for line in open(REPO / "data" / "toy_prompts.csv")][1:65]
    rows[3] = rows[10] = ""
    rows[5] = rows[20] = " ".join(["7"] * 40)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "id"])
        writer.writerows([r, i] for i, r in enumerate(rows))
    return path


def run_namespaces() -> set[str]:
    return {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}


def actor_logs(class_name: str) -> list[str]:
    """The texts of the Ray cluster's worker log files whose actor is a ``class_name`` (Ray writes
    ``:actor_name:<class>`` at the top of an actor's logs)."""
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    texts = [f.read_text(errors="replace") for f in logs.glob("worker-*")]
    return [t for t in texts if f":actor_name:{class_name}\n" in t]


# One rank with DDP, two with FSDP (routing across ranks, sharded gathers for pushes). The other
# two combinations added ~4 min on 2 cores and no path of their own (issue 16's suite budget).
@pytest.mark.parametrize("strategy,num_makers,num_workers", [("ddp", 2, 1), ("fsdp", 1, 2)])
def test_fit_accounts_for_every_item(ray_session, tmp_path, strategy, num_makers, num_workers):
    prompts = messy_prompts(tmp_path / "prompts.csv")
    cfg = small_config(tmp_path, f"trainer.strategy={strategy}", f"maker.num_makers={num_makers}",
                       f"trainer.num_workers={num_workers}", f"data.path={prompts}", "data.prompt_column=text",
                       "logging.samples_every=2")
    trainer = PPOTrainer(cfg, output_dir=tmp_path / "run")
    result = trainer.fit()

    history = trainer.history
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    for key in ("reward_mean", "reward_std", "kl", "policy_loss", "value_loss", "clipfrac", "approx_kl", "entropy",
                "policy_version", "staleness_mean", "staleness_max", "samples_per_s", "generated_tokens_per_s",
                "maker_generate_s", "train_s", "trainer_idle_ratio", "maker_idle_ratio", "push_s", "push_bytes"):
        assert key in history[-1], key
    assert result.metrics["step"] == STEPS
    versions = [m["policy_version"] for m in history]
    assert versions == sorted(versions) and versions[-1] == STEPS
    assert max(m["staleness_max"] for m in history) <= MAX_STALENESS
    assert history[-1]["weights_in_sync"] == 1.0  # every maker holds exactly the last published weights

    counters = trainer.final_status.counters
    assert counters.consumed == STEPS * BATCH * num_workers
    assert counters.produced == (counters.consumed + counters.in_flight + counters.discarded
                                    + counters.lost_in_transit)
    assert counters.blank_prompts > 0 and counters.truncated_prompts > 0
    # Every item a maker made reached the coordinator's books (sends cut short at the end count in flight).
    assert len(trainer.maker_summaries) == 2 * num_makers
    assert sum(s.get("made", 0) for s in trainer.maker_summaries) == counters.produced

    assert trainer.namespace not in run_namespaces()  # fit() removed the actors it started
    assert_checkpoint_loads(Path(result.checkpoint.path))
    # rank 0's push, not a mean over ranks: the size of the last push the coordinator relayed
    assert history[-1]["push_bytes"] == trainer.final_status.last_push.nbytes
    assert 0 < history[-1]["prompts_blank"] <= counters.blank_prompts
    assert 0 < history[-1]["prompts_truncated"] <= counters.truncated_prompts
    assert_run_files(tmp_path / "run")
    # The coordinator reads prompts with Ray Data in a thread (blocking gets off its event loop);
    # it turns Ray's warning off in its own process, not by a runtime_env (CoordinatorActor).
    coordinator_logs = actor_logs("CoordinatorActor")
    assert coordinator_logs and not any("blocking ray.get inside async actor" in t for t in coordinator_logs)


@pytest.mark.parametrize("weight_updates,schedule", [("in_flight", "fifo"), ("between_batches", "longest_first")])
def test_streaming_makers_account_for_every_item(ray_session, tmp_path, weight_updates, schedule):
    """maker.max_running: a maker generates continuously and sends each prompt's group as it
    finishes; blank and truncated prompts, exactly-once accounting, the staleness bound and the
    final weights hold as with batch-by-batch makers."""
    prompts = messy_prompts(tmp_path / "prompts.csv")
    cfg = small_config(tmp_path, "maker.num_makers=1", f"data.path={prompts}", "data.prompt_column=text",
                       "maker.max_running=6", "maker.samples_per_prompt=2", "algo.advantage=grpo",
                       f"maker.weight_updates={weight_updates}", "maker.max_new_tokens=48",
                       f"maker.schedule={schedule}")
    trainer = PPOTrainer(cfg)
    trainer.fit()
    history = trainer.history
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    assert max(m["staleness_max"] for m in history) <= MAX_STALENESS
    assert history[-1]["weights_in_sync"] == 1.0
    counters = trainer.final_status.counters
    assert counters.consumed == STEPS * BATCH
    assert counters.produced == counters.consumed + counters.in_flight + counters.discarded + counters.lost_in_transit
    assert counters.blank_prompts > 0 and counters.truncated_prompts > 0
    assert sum(s.get("made", 0) for s in trainer.maker_summaries) == counters.produced
    spanning = sum(s.get("spanning_swaps", 0) for s in trainer.maker_summaries)
    print(f"{weight_updates}: {spanning} sequences spanned a weight swap")
    # item 6's figures, in every row: a token is never older than its item's oldest token
    for m in history:
        assert m["token_lag_mean"] <= m["token_lag_max"] <= m["staleness_max"]
        assert 0 <= m["maker_sequences_running"] <= 6 and m["kv_recomputed"] == 0  # kv_at_swap=keep
    assert any(0 < m.get("maker_slot_utilisation", 0) <= 1 for m in history)
    if weight_updates == "between_batches":  # swaps wait until no sequence runs
        assert spanning == 0 and all(m["swaps_per_sequence"] == 0 and m["kv_kept"] == 0 for m in history)


def test_streaming_makers_run_episodes_turn_by_turn(ray_session, tmp_path):
    """maker.max_running with env.cls: each policy turn is a request of the maker's batcher and the
    next turn queues when the environment answers (ray_ppo.makers.testing.FaultyEnv: steps that
    sleep 50-200 ms; prompts starting with 0 make the step raise). Faulted episodes end alone,
    every prompt is trained once, and no trained token is older than its item's staleness."""
    prompts = tmp_path / "prompts.csv"
    texts = [("0" if i % 8 == 5 else "3") + t[1:] for i, t in enumerate(make_prompts(64, 6, seed=0))]
    prompts.write_text("prompt\n" + "\n".join(texts) + "\n")
    cfg = small_config(tmp_path, "maker.num_makers=1", f"data.path={prompts}", "maker.max_running=6",
                       "maker.samples_per_prompt=2", "algo.advantage=grpo", "env.cls=ray_ppo.makers.testing:FaultyEnv",
                       "env.max_tokens=32", "env.step_timeout_s=2")
    trainer = PPOTrainer(cfg)
    trainer.fit()
    history = trainer.history
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    assert all(1.0 <= m["env/turns"] <= 2.0 for m in history) and any(m["env/turns"] > 1.5 for m in history)
    assert sum(m["fault_count"] for m in history) > 0
    assert history[-1]["weights_in_sync"] == 1.0
    counters = trainer.final_status.counters
    assert counters.consumed == STEPS * BATCH
    assert counters.produced == counters.consumed + counters.in_flight + counters.discarded + counters.lost_in_transit
    assert sum(s.get("made", 0) for s in trainer.maker_summaries) == counters.produced
    for m in history:
        assert m["token_lag_mean"] <= m["token_lag_max"] <= m["staleness_max"]


def test_streaming_makers_train_agents_through_their_endpoints(ray_session, tmp_path):
    """agent.fn: each maker serves its OpenAI-compatible endpoint and the agents (ray_ppo.makers.testing
    .faulty_agent: two calls with the openai client, 50-200 ms between them) run beside generation.
    Prompts starting with 0, 1, 2 or 4 make the agent raise, hang past agent.timeout_s, return no
    number or edit its history: those episodes end alone as faults; every prompt is trained once."""
    prompts = tmp_path / "prompts.csv"
    texts = [(str(i % 8) if i % 8 in (0, 1, 2, 4) else "3") + t[1:] for i, t in enumerate(make_prompts(64, 6, seed=0))]
    prompts.write_text("prompt\n" + "\n".join(texts) + "\n")
    cfg = small_config(tmp_path, "maker.num_makers=1", f"data.path={prompts}", "maker.max_running=6",
                       "maker.samples_per_prompt=2", "algo.advantage=grpo", "model.pretrained=tiny-chat",
                       "data.chat_template=true", "agent.fn=ray_ppo.makers.testing:faulty_agent",
                       "env.max_tokens=32", "agent.timeout_s=3", "logging.samples_every=1")
    trainer = PPOTrainer(cfg, output_dir=tmp_path / "run")
    trainer.fit()
    history = trainer.history
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    assert all(1.0 <= m["env/turns"] <= 2.0 for m in history) and any(m["env/turns"] > 1.5 for m in history)
    assert 0 < sum(m["fault_count"] for m in history) < STEPS * BATCH
    assert history[-1]["weights_in_sync"] == 1.0
    counters = trainer.final_status.counters
    assert counters.consumed == STEPS * BATCH
    assert counters.produced == counters.consumed + counters.in_flight + counters.discarded + counters.lost_in_transit
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    problems = " ".join(str(s) for s in samples)
    assert "the agent raised RuntimeError: the agent broke" in problems or "does not extend" in problems


@pytest.mark.parametrize("streaming", [False, True], ids=["batch", "streaming"])
def test_dynamic_sampling_drops_uniform_groups_and_their_prompts_count_as_consumed(ray_session, tmp_path, streaming):
    """algo.dynamic_sampling: makers drop the groups whose rewards are all equal, report their prompts
    as consumed (no item), and draw more; every step still trains BATCH items, and the ledger's
    counts add up: every prompt served was trained, dropped, blank or is still in flight."""
    cfg = small_config(tmp_path, "maker.num_makers=1", "maker.samples_per_prompt=2", "algo.advantage=grpo",
                       "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_draws=50", "maker.max_new_tokens=2",
                       *(["maker.max_running=6"] if streaming else []))
    trainer = PPOTrainer(cfg)
    trainer.fit()
    history = trainer.history
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    counters = trainer.final_status.counters
    assert counters.consumed == STEPS * BATCH and counters.dropped_prompts > 0
    # the last row is read while makers still run; the final counts may have grown since
    assert 0 < history[-1]["prompts_dropped"] <= counters.dropped_prompts
    assert 0 < history[-1]["groups_dropped_share"] < 1
    assert sum(s.get("made", 0) for s in trainer.maker_summaries) == counters.produced
    in_flight_prompts = (counters.produced - counters.consumed - counters.discarded) // 2
    assert counters.prompts_served == (counters.prompts_trained + counters.dropped_prompts + counters.blank_prompts
                                       + in_flight_prompts + counters.prompts_requeued)


def test_output_dir_holds_the_checkpoint_and_each_row_counts_the_prompts_trained_by_its_step(ray_session, tmp_path):
    """``PPOTrainer(cfg, output_dir=DIR)``: Ray Train's storage is DIR/ray_train, so the result's
    checkpoint lies under DIR (not under ``logging.output_dir``). Step s's ``prompts_trained`` is
    the prompts trained at steps up to s, not those the rank pulled ahead for step s + 1 while
    step s trained (``trainer.prefetch``, the default)."""
    out = tmp_path / "run"
    cfg = small_config(tmp_path / "config_output_dir", "trainer.total_steps=2", "trainer.train_batch_size=8",
                       "maker.batch_size=4", "maker.num_makers=1")
    trainer = PPOTrainer(cfg, output_dir=out)
    result = trainer.fit()
    assert Path(result.checkpoint.path).resolve().is_relative_to(out.resolve()), result.checkpoint.path
    assert not (tmp_path / "config_output_dir").exists()
    assert [m["prompts_trained"] for m in trainer.history] == [8, 16]  # one item per prompt, none blank


def assert_run_files(run: Path) -> None:
    """PPOTrainer(output_dir=...) writes what the CLI writes."""
    from ray_ppo.outputs.tracking import read_metrics

    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))
    samples = [json.loads(line) for line in open(run / "samples.jsonl")]
    assert [s["step"] for s in samples] == [2] * 4 + [4] * 4
    assert all(isinstance(s["response"], str) and 0 <= s["reward"] <= 1 for s in samples)
    assert load_config(run / "config.yaml").logging.samples_every == 2
    assert (run / "curves.png").exists() and any((run / "tensorboard").iterdir())


def assert_checkpoint_loads(directory: Path) -> None:
    """The checkpoint's actor and critic load with the ordinary from_pretrained(path)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ray_ppo.models import Critic

    actor = AutoModelForCausalLM.from_pretrained(directory / "actor")
    AutoTokenizer.from_pretrained(directory / "actor")
    critic = Critic.from_pretrained(str(directory / "critic"))
    assert actor.config.n_layer == 2 and critic.value_head.out_features == 1
    assert f'"policy_version": {STEPS}' in (directory / "state.json").read_text()


def test_missing_column_names_the_columns(ray_session, tmp_path):
    cfg = small_config(tmp_path, f"data.path={messy_prompts(tmp_path / 'p.csv')}", "data.prompt_column=question")
    before = run_namespaces()
    with pytest.raises(DataError, match=r"'question'.*columns present: \['text', 'id'\]"):
        PPOTrainer(cfg).fit()
    assert run_namespaces() == before


def test_a_given_dataset_is_read_as_given_and_its_column_checked(ray_session, tmp_path):
    """PPOTrainer(prompts=ds): the coordinator reads the user's dataset as it is and takes the
    prompt column from each batch. No operator is added: read_csv splits even a small file into
    blocks, and a column selection after that was a task per block (benchmarks/README, Start-up)."""
    path = messy_prompts(tmp_path / "prompts.csv")
    given = ray.data.read_csv(str(path))
    dataset, column = PPOTrainer(small_config(tmp_path, "data.prompt_column=text"), prompts=given)._dataset()
    assert dataset is given and column == "text"
    with open(path) as f:
        expected = [row["text"] for row in csv.DictReader(f)]
    assert read_texts(dataset, column) == expected  # in file order, blanks and long prompts as they are
    before = run_namespaces()
    with pytest.raises(DataError, match=r"'question'.*columns present: \['text', 'id'\]"):
        PPOTrainer(small_config(tmp_path, "data.prompt_column=question"), prompts=given).fit()
    assert run_namespaces() == before  # pre-flight refused it: no actor started


def test_unreadable_file_names_the_path(ray_session, tmp_path):
    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match="nope.parquet"):
        PPOTrainer(small_config(tmp_path, f"data.path={missing}")).fit()
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match="broken.parquet"):
        PPOTrainer(small_config(tmp_path, f"data.path={broken}")).fit()


def test_reward_that_fails_the_probe_stops_fit_before_any_actor(ray_session, tmp_path):
    # A reward function with the wrong signature raises TypeError on pre-flight's probe batch.
    before = run_namespaces()
    cfg = small_config(tmp_path, "model.reward_fn=ray_ppo.tasks.toy:write_prompt_files", "trainer.total_steps=2")
    with pytest.raises(PreflightError, match=r"^model.reward_fn='ray_ppo.tasks.toy:write_prompt_files' raised TypeError"):
        PPOTrainer(cfg).fit()
    assert run_namespaces() == before


def test_a_run_larger_than_the_cluster_is_refused_before_any_actor(ray_session, tmp_path):
    """16 makers x 0.5 CPU + a trainer worker + the prompt reader on the session's 8 CPUs: the
    reader would never run and the trainer's first pull would time out minutes later."""
    from ray_ppo.config.resources import ResourceError

    before = run_namespaces()
    with pytest.raises(ResourceError, match=r"^the run reserves 9.25 CPUs \(16 makers x 0.5 CPU .*\) but the cluster has 8"):
        PPOTrainer(small_config(tmp_path, "maker.num_makers=16")).fit()
    assert run_namespaces() == before


# One fault through a whole fit (maker -> coordinator -> trainer -> the user's one line); the other
# faults' messages are checked where they are made (tests/unit/test_failures.py), on the same path.
# error.log holds the maker's own traceback: the frame that raised, the reward function's if it raised itself.
@pytest.mark.parametrize("reward, problem, frame", [
    ("nan_on_generated", r"RewardError: model.reward_fn='faulty_rewards:nan_on_generated' returned nan for prompt "
                         r"'[\d ]+' \(response '[\d ]*'\) in maker_0; a reward must be one finite float per response "
                         r"\(at experience.py:\d+\)", "in _reward_fault"),
    ("raise_on_generated", r"KeyError: '[\d ]+' \(at faulty_rewards.py:\d+\)", "in raise_on_generated"),
])
def test_reward_fault_in_a_maker_names_the_function_and_prompt(ray_session, tmp_path, reward, problem, frame):
    cfg = small_config(tmp_path, f"model.reward_fn=faulty_rewards:{reward}", "trainer.total_steps=2",
                       "maker.num_makers=1")  # one maker: a process less to start
    trainer = PPOTrainer(cfg)
    with pytest.raises(Exception) as info:
        trainer.fit()
    line = one_line(info.value)  # what the CLI prints
    assert re.fullmatch(rf"RuntimeError: maker_0 failed \(1/1 makers failed\): {problem}", line), line
    assert trainer.namespace not in run_namespaces()
    report_failure(info.value, tmp_path)
    log = (tmp_path / ERROR_LOG).read_text()
    assert "Where the error began, in another process:" in log and frame in log, log[-3000:]


def test_runs_get_separate_namespaces(ray_session, tmp_path):
    a, b = PPOTrainer(small_config(tmp_path)), PPOTrainer(small_config(tmp_path))
    assert a.namespace != b.namespace and a.namespace.startswith("ray_ppo.tiny.")


def test_lora_only_pushes_into_a_streaming_int8_maker_in_a_run_its_time_budget_ends(ray_session, tmp_path):
    """Three paths of their own in one fit (a fit costs ~30 s of start-up on 2 cores):
    - pushes carry the LoRA adapters alone (sync.lora_only) into a streaming maker
      (maker.max_running) that generates from an int8 copy of its float model
      (maker.quantization), rebuilt with the adapters merged after each push and swapped in
      between two decode steps (a full push into an int8 maker, batch by batch and streaming:
      tests/unit/test_quantize.py);
    - trainer.time_budget_s ends the run, and trainer.prefetch (the default) has pulled the next
      step's batch while the last step trained: that batch goes back untrained, and every count
      still adds up to the steps that ran."""
    overrides = ["model.lora.rank=4", "model.lora.critic=true", "sync.lora_only=true", "maker.quantization=int8",
                 "maker.max_running=8", "trainer.total_steps=1000", "trainer.time_budget_s=4"]
    trainer = PPOTrainer(small_config(tmp_path, "maker.num_makers=1", *overrides))  # one maker: a process less to start
    trainer.fit()
    steps = len(trainer.history)
    last = trainer.history[-1]
    assert 1 <= steps < 1000 and [m["step"] for m in trainer.history] == list(range(1, steps + 1))
    assert last["weights_in_sync"] == 1.0 and last["policy_version"] == steps
    assert 0.0 <= last["reward_mean"] <= 1.0 and last["response_length"] > 0
    counters = trainer.final_status.counters
    assert counters.consumed == steps * BATCH
    assert counters.prompts_trained == counters.consumed  # one item per prompt, none blank in the toy file
    assert counters.produced == (counters.consumed + counters.in_flight + counters.discarded
                                 + counters.lost_in_transit)
    full = PPOTrainer(small_config(tmp_path)).ppo_config  # same model without LoRA, for the byte count
    # adapters + critic adapters + value head only: far fewer bytes than the whole model
    assert 0 < last["push_bytes"] < 0.2 * _model_bytes(full)


def _model_bytes(cfg) -> int:
    from ray_ppo.models.build import build_actor, build_critic

    return sum(v.numel() * v.element_size() for m in (build_actor(cfg), build_critic(cfg))
               for v in m.state_dict().values())
