"""The ColossalAI strategies on a machine without CUDA or without colossalai: clear one-line errors,
and no colossalai import unless such a strategy is chosen. (The Booster path itself is tested in
tests/colossalai_pinned, in the pinned environment of ``make test-colossalai``.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ray_ppo.config import COLOSSALAI_STRATEGIES, Config, ConfigError
from ray_ppo.train.strategies import make_strategy

ROOT = Path(__file__).parents[2]
no_colossalai = pytest.mark.skipif(importlib.util.find_spec("colossalai") is not None,
                                   reason="colossalai is installed here")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


@no_cuda
@pytest.mark.parametrize("strategy", COLOSSALAI_STRATEGIES)
@pytest.mark.parametrize("use_gpu", [True, False])
def test_choosing_a_colossalai_strategy_without_cuda_fails_validation(strategy, use_gpu):
    with pytest.raises(ConfigError) as info:
        Config().with_overrides({"trainer.strategy": strategy, "trainer.use_gpu": use_gpu})
    message = str(info.value)
    assert "\n" not in message
    assert f"trainer.strategy={strategy!r} needs CUDA" in message
    assert "trainer.strategy=fsdp" in message


@no_colossalai
@pytest.mark.parametrize("strategy", COLOSSALAI_STRATEGIES)
def test_make_strategy_without_colossalai_says_how_to_get_it(strategy):
    with pytest.raises(ImportError) as info:
        make_strategy(strategy, "cuda")
    message = str(info.value)
    assert "\n" not in message
    assert "pip install 'ray_ppo[colossalai]'" in message
    assert "trainer.strategy=fsdp" in message


def test_strategies_module_does_not_import_colossalai():
    code = ("import sys; from ray_ppo.train.strategies import make_strategy; make_strategy('ddp'); "
            "make_strategy('fsdp'); print('colossalai' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False"
