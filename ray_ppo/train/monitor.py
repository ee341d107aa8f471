"""Rank 0's view of the makers, read from the coordinator: generation throughput, idle ratio and
counters per step, and the end-of-run check that every maker holds the published weights."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray_ppo.cluster.handles import CoordinatorClient

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 60.0
"""How long the last step waits for every maker to load the final push before comparing weights."""


class MakerMonitor:
    """Generation throughput and maker idle ratio since the previous step, from the coordinator's totals."""

    def __init__(self, coordinator: CoordinatorClient, engine_gaps: bool = False, streaming: bool = False,
                 dynamic_sampling: bool = False):
        self.coordinator = coordinator
        self.dynamic_sampling = dynamic_sampling  # algo.dynamic_sampling: report the groups dropped
        self.last = {"tokens": 0.0, "generate_s": 0.0, "idle_s": 0.0, "slot_steps": 0.0, "slot_capacity": 0.0}
        self.streaming = streaming  # maker.max_running > 0: report the makers' slots and caches
        self.gaps_seen = 0
        self.engine_gaps = engine_gaps  # vLLM makers: relay their log-prob gap (engine_logprob_gap_*)
        self.evals_seen = 0

    def metrics(self, step_s: float, step: int) -> dict[str, float]:
        """The makers' figures since the previous call (``step_s`` ago) and the counters, read from
        the coordinator now (rank 0's report thread: not on the step's path); ``prompts_trained``
        counts the prompts trained at steps up to ``step``, not the next step's pulled ahead."""
        status = self.coordinator.call("status", step)
        makers = status.makers.values()
        totals = {key: sum(getattr(m, key) for m in makers) for key in self.last}
        delta = {key: totals[key] - self.last[key] for key in totals}
        self.last = totals
        n = max(1, len(status.makers))
        counters = status.counters
        return {"generated_tokens_per_s": delta["tokens"] / step_s, "maker_generate_s": delta["generate_s"] / n,
                "maker_idle_ratio": min(1.0, delta["idle_s"] / (n * step_s)),
                "items_produced": float(counters.produced), "items_consumed": float(counters.consumed),
                "items_discarded": float(counters.discarded), "items_in_flight": float(counters.in_flight),
                "items_lost_in_transit": float(counters.lost_in_transit),
                "prompts_trained": float(counters.prompts_trained),
                "prompts_requeued": float(counters.prompts_requeued),
                "prompts_served": float(counters.prompts_served), "prompts_blank": float(counters.blank_prompts),
                "prompts_truncated": float(counters.truncated_prompts), "prompts_lost": float(counters.lost),
                **(self._dropped(counters) if self.dynamic_sampling else {}),
                **(self._logprob_gap() if self.engine_gaps else {}),
                **(self._streaming(makers, delta) if self.streaming else {})}

    @staticmethod
    def _dropped(counters) -> dict[str, float]:
        """``algo.dynamic_sampling``: the prompts whose group was dropped so far (the extra prompts
        drawn) and their share of the groups finished (dropped or trained)."""
        finished = counters.dropped_prompts + counters.prompts_trained
        return {"prompts_dropped": float(counters.dropped_prompts),
                "groups_dropped_share": counters.dropped_prompts / finished if finished else 0.0}

    @staticmethod
    def _streaming(makers, delta: dict[str, float]) -> dict[str, float]:
        """Streaming makers: sequences running at their last sends, the share of decode-step slots
        that held one since the previous step (absent if no maker reported a step since), and the
        caches weight swaps kept or recomputed so far."""
        slots = {"maker_slot_utilisation": delta["slot_steps"] / delta["slot_capacity"]} if delta["slot_capacity"] else {}
        return {"maker_sequences_running": float(sum(m.running for m in makers)), **slots,
                "kv_kept": float(sum(m.kv_kept for m in makers)),
                "kv_recomputed": float(sum(m.kv_recomputed for m in makers))}

    def evals(self, wait: bool = False) -> list:
        """The ``EvalReport``s finished since the previous call; ``wait``: once every evaluation
        asked for has finished (the run's last step)."""
        if wait:
            self.coordinator.call("evals_done")
        reports = self.coordinator.call("evals_since", self.evals_seen)
        self.evals_seen += len(reports)
        return reports

    def _logprob_gap(self) -> dict[str, float]:
        """engine_logprob_gap_mean / _max over the tokens sampled by vLLM makers since the previous step."""
        gaps = self.coordinator.call("logprob_gaps_since", self.gaps_seen)
        self.gaps_seen += len(gaps)
        tokens = sum(n for _, _, n in gaps)
        if not tokens:
            return {}
        return {"engine_logprob_gap_mean": sum(s for s, _, _ in gaps) / tokens,
                "engine_logprob_gap_max": max(m for _, m, _ in gaps)}


def verify_makers(coordinator: CoordinatorClient, version: int, expected: str) -> float:
    """1.0 if every maker loaded push ``version`` and holds exactly the published weights."""
    coordinator.call("wait_for_version", version, VERIFY_TIMEOUT_S)
    prints = coordinator.call("maker_fingerprints")
    behind = {i: v for i, (v, _) in prints.items() if v != version}
    differ = sorted(i for i, (v, fp) in prints.items() if v == version and fp != expected)
    if behind or differ:  # the metric says 0.0; the log says which maker and why
        logger.warning("weights_in_sync=0 after push v%d: %s", version, "; ".join(
            [f"maker_{i} still holds v{v} after {VERIFY_TIMEOUT_S:.0f} s" for i, v in sorted(behind.items())]
            + [f"maker_{i} holds v{version} with other weights than the trainer's" for i in differ]))
    return float(not behind and not differ)
