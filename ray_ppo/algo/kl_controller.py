"""Controllers for the KL penalty coefficient beta in r_t = -beta * KL_t (+ score at the last token)."""

from __future__ import annotations

from typing import Any, Protocol


class KLController(Protocol):
    """Holds the current KL coefficient `value` and updates it from the measured KL."""

    value: float
    adapts: bool  # whether ``update`` can change ``value``

    def update(self, current_kl: float, n_steps: int) -> None:
        """Update ``value`` after a step.

        Args:
            current_kl: the step's measured mean per-token KL to the reference.
            n_steps: the number of samples since the last update.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """The controller's state, for a checkpoint.

        Returns:
            Dict of plain floats and ints (``load_state_dict`` takes it back).
        """
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state ``state_dict`` returned.

        Args:
            state_dict: a dict that ``state_dict`` returned.
        """
        ...


class FixedKLController:
    """A constant KL coefficient.

    Args:
        kl_coef: the coefficient, >= 0.

    Raises:
        ValueError: if ``kl_coef`` < 0.
    """

    adapts = False

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient unchanged.

        Args:
            current_kl: the step's measured mean per-token KL (unused).
            n_steps: the number of samples since the last update (unused).
        """

    def state_dict(self) -> dict[str, Any]:
        """The controller's state, for a checkpoint.

        Returns:
            Dict of plain floats and ints (``load_state_dict`` takes it back).
        """
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state ``state_dict`` returned.

        Args:
            state_dict: a dict that ``state_dict`` returned.
        """
        self.value = float(state_dict["value"])


class AdaptiveKLController:
    """Steers the measured KL towards `target` by scaling the coefficient, over `horizon` samples.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593,
    section 2.2 (and `AdaptiveKLController` in openai/lm-human-preferences):
        e_t = clip(KL_t / KL_target - 1, -0.2, 0.2),   beta_{t+1} = beta_t * (1 + K_beta * e_t)
    with K_beta = n_steps / horizon, n_steps the number of samples since the last update.

    Args:
        init_kl_coef: the starting coefficient, >= 0.
        target: the KL to steer towards, > 0.
        horizon: the number of samples over which the coefficient adapts, > 0.

    Raises:
        ValueError: if a bound above is broken.
    """

    adapts = True

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"need init_kl_coef >= 0, target > 0 and horizon > 0; got {init_kl_coef}, {target}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale `value` by 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon.

        Args:
            current_kl: the step's measured mean per-token KL to the reference.
            n_steps: the number of samples since the last update.
        """
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        mult = 1 + proportional_error * n_steps / self.horizon
        self.value *= mult

    def state_dict(self) -> dict[str, Any]:
        """The controller's state, for a checkpoint.

        Returns:
            Dict of plain floats and ints (``load_state_dict`` takes it back).
        """
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state ``state_dict`` returned.

        Args:
            state_dict: a dict that ``state_dict`` returned.
        """
        self.value = float(state_dict["value"])
        self.target = float(state_dict["target"])
        self.horizon = int(state_dict["horizon"])


def make_kl_controller(kl_coef: float, kl_target: float | None = None, kl_horizon: int = 10000) -> KLController:
    """An AdaptiveKLController starting at `kl_coef` if `kl_target` is set, else a FixedKLController.

    Args:
        kl_coef: the initial (or fixed) coefficient, >= 0.
        kl_target: the KL the adaptive controller steers towards; None for a fixed coefficient.
        kl_horizon: the adaptive controller's horizon in samples.

    Returns:
        The controller.

    Raises:
        ValueError: if ``kl_coef`` < 0, or with a target, ``kl_target`` or ``kl_horizon`` is not > 0.
    """
    if kl_target is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, kl_target, kl_horizon)
