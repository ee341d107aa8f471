"""The one place ``ray_ppo`` leans on a private part of Ray: ``PPOTrainer._register_sigint_handler``
replaces Ray Train's own Ctrl-C handler (which swallows the interrupt and exits later with status 0
or 1), so ``fit()`` sees a ``KeyboardInterrupt`` and aborts the run itself. If a Ray upgrade renames
the hook or stops calling it, Ctrl-C would silently go back to Ray's handler: these checks fail
first, naming what moved. (``tests/e2e/test_cli_resume.py`` presses Ctrl-C on a real run.)"""

from __future__ import annotations

import inspect

from ray.train.torch import TorchTrainer

from ray_ppo.api import PPOTrainer

HOOK = "_register_sigint_handler"


def ray_owner_of(name: str) -> type:
    """The class of Ray's trainer hierarchy that defines ``name``."""
    for cls in TorchTrainer.__mro__:
        if name in vars(cls):
            return cls
    raise AssertionError(f"Ray's TorchTrainer no longer has {name}: PPOTrainer's Ctrl-C adapter in ray_ppo/api.py "
                         f"overrides nothing; find where Ray Train registers its SIGINT handler now")


def test_ray_still_has_the_hook_with_the_signature_we_override():
    owner = ray_owner_of(HOOK)
    theirs = list(inspect.signature(getattr(owner, HOOK)).parameters)
    ours = list(inspect.signature(getattr(PPOTrainer, HOOK)).parameters)
    assert theirs == ["self", "controller"] == ours, (theirs, ours)


def test_ray_still_calls_the_hook_when_it_starts_its_controller():
    owner = ray_owner_of(HOOK)
    callers = [name for name, fn in vars(owner).items()
               if callable(fn) and name != HOOK and f"self.{HOOK}(controller)" in inspect.getsource(fn)]
    assert callers, f"no method of {owner.__qualname__} calls self.{HOOK}(controller) any more"


def test_the_override_keeps_the_controller_for_the_abort():
    trainer = PPOTrainer.__new__(PPOTrainer)  # no fit(), no cluster: the hook alone
    controller = object()
    trainer._register_sigint_handler(controller)
    assert trainer._controller is controller
