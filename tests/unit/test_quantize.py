"""int8 makers: generation stays valid and pushes re-quantize from the new float weights."""

import pytest
import torch

from ray_ppo.config import Config
from ray_ppo.makers.worker import MakerWorker
from ray_ppo.models import SamplingParams, action_log_probs, action_logits, generate, load_actor
from ray_ppo.models.continuous import ContinuousBatcher, Request
from ray_ppo.models.quantize import quantize_for_generation
from ray_ppo.wire.messages import PushHeader


def test_int8_copy_is_close_and_generates(tiny_path):
    actor = load_actor(tiny_path)
    q = quantize_for_generation(actor)
    assert "quantized.dynamic" in type(q.transformer.h[0].attn.c_attn).__module__  # Conv1D got quantized too
    assert type(actor.transformer.h[0].attn.c_attn).__name__ == "Conv1D"  # the float model is untouched
    rollout = generate(q, [[3, 4, 5], [6, 7]], SamplingParams(max_new_tokens=6), pad_token_id=0, eos_token_id=1)
    assert rollout.sequences.shape == (2, 3 + rollout.num_actions)
    assert ((rollout.sequences >= 0) & (rollout.sequences < 13)).all()
    args = (rollout.sequences, rollout.attention_mask, rollout.num_actions)
    assert torch.allclose(action_logits(q, *args), action_logits(actor, *args), atol=0.1)


def test_unknown_method_and_gpu_are_refused(tiny_path):
    with pytest.raises(ValueError, match="int4"):
        quantize_for_generation(load_actor(tiny_path), "int4")


def push(worker: MakerWorker, tiny_path: str, version: int) -> torch.nn.Module:
    """Push the tiny actor with noise on every weight into ``worker`` (as ``version``); returns it."""
    torch.manual_seed(0)
    new = load_actor(tiny_path)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.2 * torch.randn_like(p))
    state = {f"actor.{k}": v for k, v in new.state_dict().items()}
    state.update({f"critic.{k}": v for k, v in worker.maker.critic.state_dict().items()})
    worker.weights_start(PushHeader(version, 1, 0, kl_coef=0.05))
    worker.receiver.staging.stage(state)  # what weights_chunk does with each bucket from the object store
    worker.receiver.staging.seen.add(0)
    assert worker.weights_end(version) is True
    return new


def test_push_to_quantized_maker_requantizes(tiny_path):
    cfg = Config().with_overrides({"model.pretrained": tiny_path, "maker.quantization": "int8"})
    worker = MakerWorker(0, cfg.to_dict(), coordinator=None)  # the plain class, no Ray needed here
    old_generator = worker.maker.actor
    new = push(worker, tiny_path, 1)
    assert worker.version == 1 and worker.maker.actor is not old_generator
    x = torch.tensor([[3, 4, 5, 6]])
    mask = torch.ones_like(x)
    expected = action_logits(quantize_for_generation(new), x, mask, 2)
    torch.testing.assert_close(action_logits(worker.maker.actor, x, mask, 2), expected)
    assert not torch.allclose(action_logits(old_generator, x, mask, 2), expected, atol=1e-3)


def test_a_streaming_int8_maker_decodes_on_with_the_pushed_weights_int8_copy(tiny_path):
    """maker.max_running with maker.quantization: a push lands between two decode steps, and the
    running sequences go on sampling from a fresh int8 copy of the new float weights."""
    cfg = Config().with_overrides({"model.pretrained": tiny_path, "maker.quantization": "int8", "maker.max_running": 2,
                                   "maker.kv_at_swap": "recompute"})
    worker = MakerWorker(0, cfg.to_dict(), coordinator=None)
    old_generator = worker.maker.actor
    worker.batcher = batcher = ContinuousBatcher(old_generator, cfg.maker, 0, stop_ids=[], max_running=2,
                                                 kv_at_swap="recompute", generator=torch.Generator().manual_seed(1))
    batcher.submit([Request("a", [3, 4, 5], 8), Request("b", [6, 7, 8], 8)])
    for _ in range(3):
        assert batcher.step() == []
    new = push(worker, tiny_path, 1)
    assert batcher.model is worker.maker.actor and batcher.model is not old_generator
    assert "quantized.dynamic" in type(batcher.model.transformer.h[0].attn.c_attn).__module__
    done = []
    while batcher.busy:
        done += batcher.step()
    assert len(done) == 2
    for f in done:
        assert f.version_runs == [(0, 4), (1, 4)]
        sequence = torch.tensor([f.prompt + f.tokens])
        later = lambda model: action_log_probs(model, sequence, torch.ones_like(sequence), 8)[0, 4:]  # noqa: E731
        sampled = torch.tensor(f.log_probs[4:])
        to_new, to_old = ((sampled - later(model)).abs().mean() for model in (quantize_for_generation(new), old_generator))
        # Dynamic quantization scales activations per batch, so a row alone is close, not equal.
        assert to_new < 0.1 < 0.5 < to_old, (to_new, to_old)
