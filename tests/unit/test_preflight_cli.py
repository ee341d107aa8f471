"""Pre-flight through the CLI: every input that can be checked without a cluster fails in one line,
with status 2, in seconds, and before any Ray process starts (issue 16's list of cases)."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import psutil
import pytest

from ray_ppo.cli import EXIT_USAGE, main
from ray_ppo.config import load_config
from ray_ppo.config.preflight import PreflightError, check_run

ROOT = Path(__file__).parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
FAIL_WITHIN_S = 20.0
"""Pre-flight loads a tokenizer and reads a few rows: seconds, even on a busy 2-core machine."""

REWARDS = '''
def nan_reward(prompts, responses):
    return [float("nan")] * len(responses)

def short_reward(prompts, responses):
    return [0.0] * (len(responses) - 1)

def text_reward(prompts, responses):
    return ["good"] * len(responses)

def raising_reward(prompts, responses):
    raise KeyError("label")

def nan_on_generated(prompts, responses):  # passes the probe (an empty response, the prompt itself)
    return [0.0 if not r or r == p else float("nan") for p, r in zip(prompts, responses)]
'''

pytestmark = pytest.mark.usefixtures("tiny_path", "no_ray_in_this_process")


@pytest.fixture(scope="module")
def no_ray_in_this_process():
    """These tests check that a command never initialised Ray: end the cluster that an earlier
    module of the session (tests/ray's session fixture) left connected in this process."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _files(tmp: Path) -> dict[str, Path]:
    files = {
        "header.csv": b"prompt\n", "empty.csv": b"", "binary.csv": b"PK\x03\x04\x00\x00\x08\x00" * 64,
        "blank.csv": b'prompt\n""\n"   "\n\n', "latin.csv": b"prompt\nna\xefve caf\xe9\n",
        "other_column.csv": b"question\n1 2 3\n", "bad_utf8.yaml": b"name: caf\xe9\n",
        "sweep_list.yaml": b"grid: [1, 2]\n", "sweep_top_list.yaml": b"- grid\n- metric\n",
        "sweep_scalar.yaml": b"grid:\n  ppo.kl_coef: 0.1\n", "sweep_bad_yaml.yaml": b"grid: {ppo.kl_coef: [0.1\n",
        "sweep_utf8.yaml": b"metric: r\xe9ward\n", "rewards_mod.py": REWARDS.encode(),
    }
    for name, content in files.items():
        (tmp / name).write_bytes(content)
    return {name: tmp / name for name in files}


def _cases(f: dict[str, Path]) -> list[tuple[str, list[str], str]]:
    """(id, extra argv after ``train --config TINY``, the exact line printed)."""
    return [
        ("pretrained", ["model.pretrained=/nonexistent"],
         "ray-ppo train: error: model.pretrained='/nonexistent' does not exist; set model.pretrained to a model "
         "directory (one with config.json), a hub name, or tiny for the built-in tiny model"),
        ("pretrained_not_a_model", [f"model.pretrained={f['header.csv'].parent}"],
         f"ray-ppo train: error: model.pretrained='{f['header.csv'].parent}' has no config.json, so it is not a saved "
         f"model; set model.pretrained to a directory written by save_pretrained, or tiny for the built-in tiny model"),
        ("critic_missing", ["model.critic_pretrained=./no_such_critic"],
         "ray-ppo train: error: model.critic_pretrained='./no_such_critic' does not exist; set "
         "model.critic_pretrained to a model directory (one with config.json), a hub name, or tiny for the "
         "built-in tiny model"),
        ("reward_import", ["model.reward_fn=nomodule:fn"],
         "ray-ppo train: error: model.reward_fn='nomodule:fn' cannot be imported: no module named 'nomodule' in the "
         "current directory, on PYTHONPATH or among the installed packages; set model.reward_fn to module:function "
         "of an importable module (e.g. ray_ppo.tasks.toy:reward)"),
        ("reward_attr", ["model.reward_fn=ray_ppo.tasks.toy:nope"],
         "ray-ppo train: error: model.reward_fn='ray_ppo.tasks.toy:nope' cannot be imported: module "
         "'ray_ppo.tasks.toy' has no attribute 'nope'; set model.reward_fn to module:function of an importable "
         "module (e.g. ray_ppo.tasks.toy:reward)"),
        ("reward_nan", ["model.reward_fn=rewards_mod:nan_reward"],
         "ray-ppo train: error: model.reward_fn='rewards_mod:nan_reward' returned nan for the probe prompt "
         "'6 6 0 4 8 7' (response ''); it must return one finite float per response"),
        ("reward_short", ["model.reward_fn=rewards_mod:short_reward"],
         "ray-ppo train: error: model.reward_fn='rewards_mod:short_reward' returned 1 scores for 2 responses for a "
         "probe batch of 2 prompts; it must return one finite float per response"),
        ("reward_text", ["model.reward_fn=rewards_mod:text_reward"],
         "ray-ppo train: error: model.reward_fn='rewards_mod:text_reward' returned 'good' (str), not a number, for "
         "the probe prompt '6 6 0 4 8 7' (response ''); it must return one finite float per response"),
        ("reward_raises", ["model.reward_fn=rewards_mod:raising_reward"],
         "ray-ppo train: error: model.reward_fn='rewards_mod:raising_reward' raised KeyError: 'label' on a probe "
         "batch of 2 prompts (e.g. '6 6 0 4 8 7'); fix the function so it accepts (prompts, responses) lists of "
         "strings"),
        ("chat_template", ["data.chat_template=true"],
         "ray-ppo train: error: data.chat_template=true, but the tokenizer of 'tiny' has no chat template; set "
         "data.chat_template=false, or model.tokenizer to a chat model's tokenizer"),
        ("header_only_csv", [f"data.path={f['header.csv']}"],
         f"ray-ppo train: error: data.path='{f['header.csv']}' has no rows (only a header, or no records); add "
         f"prompts to its 'prompt' column, one per row"),
        ("empty_csv", [f"data.path={f['empty.csv']}"],
         f"ray-ppo train: error: data.path='{f['empty.csv']}': empty.csv is empty (0 bytes); give a csv file with a "
         f"'prompt' column and one prompt per row"),
        ("binary_csv", [f"data.path={f['binary.csv']}"],
         f"ray-ppo train: error: data.path='{f['binary.csv']}': binary.csv is binary, not csv text; give a csv file, "
         f"or set data.format to the file's real format (csv, parquet, json)"),
        ("blank_prompts", [f"data.path={f['blank.csv']}"],
         f"ray-ppo train: error: data.prompt_column='prompt' of '{f['blank.csv']}' holds no non-blank prompt; fill "
         f"in the prompts, or set data.prompt_column to the column that holds them"),
        ("non_utf8_csv", [f"data.path={f['latin.csv']}"],
         f"ray-ppo train: error: data.path='{f['latin.csv']}': latin.csv is not UTF-8 text (byte 0xef at offset "
         f"9); re-save it as UTF-8"),
        ("missing_column", [f"data.path={f['other_column.csv']}"],
         f"ray-ppo train: error: data.prompt_column='prompt' is not a column of '{f['other_column.csv']}'; columns "
         f"present: ['question']; set data.prompt_column to one of them"),
        ("context", ["data.max_prompt_len=100", "maker.max_new_tokens=40"],
         "ray-ppo train: error: data.max_prompt_len (100) + maker.max_new_tokens (40) = 140 tokens, but "
         "model.pretrained='tiny' has 128 positions; lower data.max_prompt_len or maker.max_new_tokens so that they "
         "add up to at most 128"),
        ("eps_clip", ["ppo.eps_clip=5"],
         "ray-ppo train: error: ppo.eps_clip=5.0 is invalid: must be in (0, 1); set e.g. ppo.eps_clip=0.2 (the default)"),
    ]


def _run(argv: list[str]) -> tuple[int, float, set[int]]:
    """main(argv): its status, seconds, and the processes it left or started (Ray's would be children)."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    start = time.perf_counter()
    status = main(argv)
    seconds = time.perf_counter() - start
    return status, seconds, {p.pid for p in me.children(recursive=True)} - before


def _assert_one_line_before_ray(capsys, status, seconds, new_processes, expected):
    import sys

    err = capsys.readouterr().err
    assert err.splitlines() == [expected]
    assert status == EXIT_USAGE
    assert seconds < FAIL_WITHIN_S, f"took {seconds:.1f} s"
    assert not new_processes, "a process (Ray?) was started"
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs/tiny.yaml names data/toy_prompts.csv relative to the repository
    monkeypatch.syspath_prepend(str(tmp_path))  # rewards_mod
    return _files(tmp_path)


CASE_IDS = [case[0] for case in _cases(collections.defaultdict(lambda: Path("unused")))]


@pytest.mark.parametrize("case", CASE_IDS)
def test_train_fails_before_ray_in_one_line(case, files, tmp_path, capsys):
    _, extra, expected = next(c for c in _cases(files) if c[0] == case)
    out = tmp_path / "run"
    status, seconds, new = _run(["train", "--config", TINY, "--output", str(out), *extra])
    _assert_one_line_before_ray(capsys, status, seconds, new, expected)
    assert not out.exists(), "a run that fails pre-flight leaves no run directory"


def test_non_utf8_config(files, capsys):
    status, seconds, new = _run(["train", "--config", str(files["bad_utf8.yaml"])])
    _assert_one_line_before_ray(capsys, status, seconds, new, (
        f"ray-ppo train: error: config file '{files['bad_utf8.yaml']}' is not UTF-8 text (byte 0xe9 at offset 9); "
        f"re-save it as UTF-8"))


@pytest.mark.parametrize("name, problem", [
    ("sweep_list.yaml", "grid must map config keys to lists of values, got a list; e.g. "
                        "'grid: {ppo.kl_coef: [0.02, 0.1]}'"),
    ("sweep_top_list.yaml", "the top level must be a mapping with keys grid, metric, mode, num_samples, got a list; "
                            "e.g. 'grid: {ppo.kl_coef: [0.02, 0.1]}'"),
    ("sweep_scalar.yaml", "grid.ppo.kl_coef must be a non-empty list of values, got 0.1; e.g. 'ppo.kl_coef: [0.1, ...]'"),
])
def test_malformed_sweep_file(files, capsys, name, problem):
    status, seconds, new = _run(["tune", "--config", TINY, "--sweep", str(files[name])])
    _assert_one_line_before_ray(capsys, status, seconds, new, f"ray-ppo tune: error: sweep file '{files[name]}': {problem}")


def test_sweep_file_not_yaml_or_not_utf8(files, capsys):
    status, seconds, new = _run(["tune", "--config", TINY, "--sweep", str(files["sweep_bad_yaml.yaml"])])
    _assert_one_line_before_ray(capsys, status, seconds, new, (
        f"ray-ppo tune: error: sweep file '{files['sweep_bad_yaml.yaml']}' is not valid YAML at line 2: "
        f"expected ',' or ']', but got '<stream end>'"))
    status, seconds, new = _run(["tune", "--config", TINY, "--sweep", str(files["sweep_utf8.yaml"])])
    _assert_one_line_before_ray(capsys, status, seconds, new, (
        f"ray-ppo tune: error: sweep file '{files['sweep_utf8.yaml']}' is not UTF-8 text (byte 0xe9 at offset 9); "
        f"re-save it as UTF-8"))


def test_tune_checks_the_run_before_ray(files, capsys):
    status, seconds, new = _run(["tune", "--config", TINY, "--grid", "ppo.kl_coef=0.01,0.1",
                                 "model.reward_fn=nomodule:fn"])
    _assert_one_line_before_ray(capsys, status, seconds, new, (
        "ray-ppo tune: error: model.reward_fn='nomodule:fn' cannot be imported: no module named 'nomodule' in the "
        "current directory, on PYTHONPATH or among the installed packages; set model.reward_fn to module:function "
        "of an importable module (e.g. ray_ppo.tasks.toy:reward)"))


def test_overrides_after_options_are_accepted(files, capsys):
    """Overrides before, between and after options all apply (the last one checked fails pre-flight)."""
    status, seconds, new = _run(["train", "trainer.total_steps=2", "--config", TINY, "ppo.kl_coef=0.1",
                                 "--num-cpus", "2", "model.pretrained=/nonexistent"])
    _assert_one_line_before_ray(capsys, status, seconds, new, (
        "ray-ppo train: error: model.pretrained='/nonexistent' does not exist; set model.pretrained to a model "
        "directory (one with config.json), a hub name, or tiny for the built-in tiny model"))


def test_unknown_option_is_still_rejected(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", TINY, "--nope"])
    assert exit_info.value.code == EXIT_USAGE
    assert capsys.readouterr().err.splitlines()[-1] == "ray-ppo: error: unrecognized arguments: --nope"


def test_failure_after_start_is_one_line_with_the_traceback_in_the_run_directory(files, tmp_path, capsys):
    out = tmp_path / "run"
    status = main(["local", "--config", TINY, "--output", str(out), "trainer.total_steps=1", "maker.batch_size=4",
                   "trainer.train_batch_size=4", "trainer.mini_batch_size=4", "logging.progress=false",
                   "model.reward_fn=rewards_mod:nan_on_generated"])
    (line,) = capsys.readouterr().err.splitlines()
    log = out / "error.log"
    assert status == 1
    assert line.startswith("ray-ppo local: failed: RewardError: model.reward_fn='rewards_mod:nan_on_generated' "
                           "returned nan for prompt '")
    assert line.endswith(f" in local; a reward must be one finite float per response (full traceback: {log})")
    assert "Traceback (most recent call last)" in log.read_text() and "_score" in log.read_text()


def test_bad_override_after_an_option_is_named(capsys, tmp_path):
    assert main(["local", "--config", TINY, "--output", str(tmp_path / "run"), "trainer.total_steps"]) == EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == [
        "ray-ppo local: error: bad override 'trainer.total_steps': expected the form key=value, e.g. ppo.kl_coef=0.1"]


UNUSED_REWARD_FN = ("ray-ppo train: warning: model.reward_pretrained is set, so the reward model scores the responses "
                    "and model.reward_fn='ray_ppo.tasks.toy:reward' is not used; set model.reward_fn=null to say so, "
                    "or model.reward_pretrained=null to keep the rule reward")


def test_a_reward_model_beside_the_configs_rule_reward_is_one_warning_line_once(files, tiny_reward_path, capsys):
    """configs/tiny.yaml sets model.reward_fn; a reward model added to it replaces the rule reward,
    and the command says so in one line before it goes on (here to the resource check, which
    refuses 64 trainer workers). fit() runs pre-flight again: the line is not repeated."""
    with_model = [f"model.reward_pretrained={tiny_reward_path}"]
    status, _, new = _run(["train", "--config", TINY, *with_model, "trainer.num_workers=64"])
    check_run(load_config(TINY, with_model))  # as fit() does, in the same process
    warning, error = capsys.readouterr().err.splitlines()
    assert warning == UNUSED_REWARD_FN
    assert error.startswith("ray-ppo train: error: ") and status == EXIT_USAGE and not new


def test_no_warning_where_the_config_uses_one_reward(files, tiny_reward_path, capsys):
    status, _, _ = _run(["train", "--config", TINY, f"model.reward_pretrained={tiny_reward_path}",
                         "model.reward_fn=null", "trainer.num_workers=64"])
    status_rule, _, _ = _run(["train", "--config", TINY, "trainer.num_workers=64"])
    errors = capsys.readouterr().err.splitlines()  # the resource check's, no warning
    assert len(errors) == 2 and all(line.startswith("ray-ppo train: error: ") for line in errors)
    assert status == status_rule == EXIT_USAGE


@pytest.mark.parametrize("key, extra", [("env.max_tokens", ["env.cls=ray_ppo.tasks.turns:TwoTurnEnv"]),
                                        ("eval.max_new_tokens", ["eval.path=EVAL"])])
def test_episodes_and_evaluation_answers_must_fit_the_models_positions(files, tmp_path, key, extra):
    (tmp_path / "eval.csv").write_text("prompt\n1 2 3\n")
    extra = [o.replace("EVAL", str(tmp_path / "eval.csv")) for o in extra]
    cfg = load_config(TINY, [*extra, "data.max_prompt_len=16", f"{key}=120"])
    with pytest.raises(PreflightError, match=rf"data.max_prompt_len \(16\) \+ {key} \(120\) = 136 tokens, but "
                                             rf"model.pretrained='tiny' has 128 positions"):
        check_run(cfg)
    check_run(load_config(TINY, [*extra, "data.max_prompt_len=16", f"{key}=112"]))  # exactly the model's positions


def test_an_environment_class_that_does_not_import_is_the_first_problem_named():
    cfg = load_config(TINY, ["env.cls=no_such_env:Env"])  # env.max_tokens=256 outgrows tiny's 128 positions too
    with pytest.raises(PreflightError, match="^env.cls='no_such_env:Env': cannot import module 'no_such_env'"):
        check_run(cfg)
