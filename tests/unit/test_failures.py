"""Failures after a run started: the root cause in one line, the traceback in RUN_DIR/error.log;
reward faults caught where the reward is computed, naming the function and the prompt."""

from __future__ import annotations

import math

import pytest
import torch

from ray_ppo.config import Config
from ray_ppo.coordinator.state import MakerBook
from ray_ppo.makers.experience import ExperienceMaker, RewardError
from ray_ppo.models import Critic, load_actor, load_tokenizer
from ray_ppo.outputs.failures import ERROR_LOG, one_line, report_failure, root_cause
from ray_ppo.tasks import toy


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:
        return e


def test_root_cause_unwraps_ray_train_and_task_errors():
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    cause = _raised(RuntimeError("maker_0 failed (1/2 makers failed): RewardError: nan\nsecond line"))
    task_error = RayTaskError("train_fn", "Traceback ...\n  many lines", cause).as_instanceof_cause()
    wrapped = WorkerGroupError("rank 0 failed:\n" + "traceback line\n" * 40,
                               {0: UserExceptionWithTraceback(task_error, "Traceback (most recent call last): ...")})
    assert root_cause(wrapped) is cause
    assert one_line(wrapped) == "RuntimeError: maker_0 failed (1/2 makers failed): RewardError: nan"


def _reward_that_raises(prompts, responses):
    return {"label": 1.0}[responses[0]]


def test_error_log_holds_the_traceback_of_the_maker_where_the_error_began(tmp_path):
    """A reward function raises in a maker; the trainer's pull raises the coordinator's error (pickled
    across two processes), which Ray Train wraps: error.log holds the reward function's own frames."""
    import pickle
    import traceback

    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    in_maker = _raised_by(lambda: _reward_that_raises(["1 2"], ["3"]))
    book = MakerBook(num_makers=1)
    book.fail(0, "KeyError: '3'", "".join(traceback.format_exception(in_maker)))
    failed = pickle.loads(pickle.dumps(book.failure()))
    task_error = RayTaskError("pull", "Traceback ...\n  the coordinator's frames", failed).as_instanceof_cause()
    wrapped = WorkerGroupError("rank 0 failed:\n...", {0: UserExceptionWithTraceback(task_error, "Traceback ...")})
    line = report_failure(_raised(wrapped), tmp_path)
    assert line.startswith("RuntimeError: maker_0 failed (1/1 makers failed): KeyError: '3'")
    log = (tmp_path / ERROR_LOG).read_text()
    assert "Where the error began, in another process:" in log
    assert "in _reward_that_raises" in log and 'return {"label": 1.0}[responses[0]]' in log


def _raised_by(call) -> BaseException:
    try:
        call()
    except BaseException as e:
        return e


def test_root_cause_follows_raise_from():
    try:
        try:
            raise KeyError("inner")
        except KeyError as e:
            raise ValueError("outer") from e
    except ValueError as e:
        assert one_line(e) == "KeyError: 'inner'"


def test_report_failure_writes_the_traceback_and_names_the_file(tmp_path):
    exc = _raised(RuntimeError("coordinator died"))
    line = report_failure(exc, tmp_path / "run")
    log = tmp_path / "run" / ERROR_LOG
    assert line == f"RuntimeError: coordinator died (full traceback: {log})"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: coordinator died" in text
    report_failure(_raised(ValueError("second")), tmp_path / "run")  # appended, never overwritten
    assert "coordinator died" in log.read_text() and "ValueError: second" in log.read_text()
    assert report_failure(exc, None) == "RuntimeError: coordinator died"


# -- reward faults in the maker ------------------------------------------------------------------


def nan_for_sevens(prompts, responses):
    return [math.nan if p.split()[-1] == "7" else 0.5 for p in prompts]


def one_short(prompts, responses):
    return [0.0] * (len(responses) - 1)


@pytest.fixture(scope="module")
def make(tiny_path):
    tokenizer = load_tokenizer(tiny_path)

    def run(reward_fn, prompts):
        maker = ExperienceMaker(load_actor(tiny_path), load_actor(tiny_path), Critic.from_pretrained(tiny_path),
                                tokenizer, Config().with_overrides({"maker.max_new_tokens": 3}), reward_fn=reward_fn,
                                name="maker_3")
        torch.manual_seed(0)
        return maker.make_experience([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts], 0)
    return run


def test_nan_reward_names_the_function_and_the_prompt(make):
    with pytest.raises(RewardError) as info:
        make(nan_for_sevens, ["1 2 3", "4 5 7", "8 9 0"])
    message = str(info.value)
    assert message.startswith(f"model.reward_fn='{__name__}:nan_for_sevens' returned nan for prompt '4 5 7' (response ")
    assert message.endswith(" in maker_3; a reward must be one finite float per response")


def test_wrong_length_reward_names_the_function(make):
    with pytest.raises(RewardError, match=rf"^model.reward_fn='{__name__}:one_short' returned 2 scores for 3 "
                                          r"responses for a batch of 3 prompts \(the first '1 2 3'\) in maker_3"):
        make(one_short, ["1 2 3", "4 5 6", "7 8 9"])


def test_a_good_reward_passes(make):
    items, stats = make(toy.reward, ["1 2 3", "4 5 6"])
    assert len(items) == stats.num_samples == 2 and all(0.0 <= item.reward <= 1.0 for item in items)


def test_an_actor_that_could_not_start_is_named_with_its_error():
    from ray.exceptions import ActorDiedError, RayTaskError

    init_error = _raised(ValueError("cannot load reward function 'm:f': No module named 'm'"))
    task_error = RayTaskError("maker_1:MakerWorker.__init__", "Traceback (most recent call last):\n  File ...\n"
                              "ValueError: cannot load reward function 'm:f': No module named 'm'", init_error,
                              proctitle="ray::maker_1:MakerWorker.__init__()", pid=123, ip="10.0.0.1")
    died = ActorDiedError(task_error)
    assert one_line(died) == "maker_1 could not start: ValueError: cannot load reward function 'm:f': No module named 'm'"
