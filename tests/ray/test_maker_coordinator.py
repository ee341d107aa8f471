"""Maker and coordinator actors wired by hand: weight pushes and back-pressure."""

import functools
import queue
import time
from pathlib import Path

import pytest
import ray
import torch

from ray_ppo.api import resolve_config
from ray_ppo.cluster.handles import fetch_objects, put_object
from ray_ppo.config import load_config
from ray_ppo.coordinator.actor import Coordinator
from ray_ppo.makers.testing import WaitingExperienceMaker, coordinator_config
from ray_ppo.makers.worker import MakerWorker, maker_actor_class
from ray_ppo.models import Critic, load_actor
from ray_ppo.models.sync import fingerprint, make_buckets
from ray_ppo.train.loop import _pull
from ray_ppo.wire.messages import MakerStats, PromptBatch, PullRequest, PushHeader
from ray_ppo.wire.transport import ExperienceChunk, resolve

pytestmark = pytest.mark.ray
REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def cfg():
    return resolve_config(load_config(REPO / "configs" / "tiny.yaml", ["maker.batch_size=4", "maker.num_makers=1"]))


@pytest.fixture
def actors(ray_session):
    """Actors a test starts, killed when it ends: a coordinator and its makers hold handles to
    each other, so dropping the test's handles would not end them (they would hold their CPUs
    and memory for the rest of the session)."""
    started = []
    yield started
    for actor in started:
        ray.kill(actor)


def start(cfg, actors, *, buffer_size=8, items_per_version=10_000, prompts=None, maker_factory=None):
    coordinator = ray.remote(num_cpus=0)(Coordinator).remote(
        coordinator_config(buffer_size=buffer_size, items_per_version=items_per_version,
                           prompt_batch_size=cfg.maker.batch_size), prompts=prompts)
    maker = maker_actor_class(0.5, 0).remote(0, cfg.to_dict(), coordinator, maker_factory)
    actors += [coordinator, maker]
    ray.get(coordinator.register_makers.remote({0: maker}))
    ray.get(maker.ping.remote())
    return coordinator, maker


def perturbed_state(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Trained-looking weights: every parameter nudged in place (tied weights stay tied)."""
    torch.manual_seed(seed)
    actor, critic = load_actor(cfg.model.pretrained), Critic.from_pretrained(cfg.model.pretrained)
    with torch.no_grad():
        for p in [*actor.parameters(), *critic.parameters()]:
            p.add_(0.01 * torch.randn_like(p))
    state = {f"actor.{k}": v for k, v in actor.state_dict().items()}
    state.update({f"critic.{k}": v for k, v in critic.state_dict().items()})
    return state


def put_buckets(state, bucket_mb=0.05):
    return [ray.put(b) for b in make_buckets(state, bucket_mb)]


def test_push_is_atomic_and_exact(ray_session, cfg, actors):
    coordinator, maker = start(cfg, actors)
    version0, print0 = ray.get(maker.weights_fingerprint.remote())
    state = perturbed_state(cfg, seed=1)
    refs = put_buckets(state)
    assert len(refs) > 3  # several chunks, so "some but not all" is meaningful

    # Interrupted: chunk_start and all chunks but one, then chunk_end -> refused, old weights kept.
    ray.get(maker.weights_start.remote(PushHeader(1, len(refs), 0, kl_coef=0.05)))
    for i, ref in enumerate(refs[:-1]):
        ray.get(maker.weights_chunk.remote(1, i, [ref]))
    assert ray.get(maker.weights_end.remote(1)) is False
    assert ray.get(maker.weights_fingerprint.remote()) == (version0, print0)

    # A push abandoned midway by a newer one: only the newer completes.
    ray.get(maker.weights_start.remote(PushHeader(2, len(refs), 0, kl_coef=0.05)))
    ray.get(maker.weights_chunk.remote(2, 0, [refs[0]]))
    newer = perturbed_state(cfg, seed=2)
    newer_refs = put_buckets(newer)
    ray.get(maker.weights_start.remote(PushHeader(3, len(newer_refs), 0, kl_coef=0.5)))
    for i, ref in enumerate(newer_refs):
        ray.get(maker.weights_chunk.remote(3, i, [ref]))
    assert ray.get(maker.weights_end.remote(2)) is False  # a late end of the abandoned push: push 3 stays staged
    assert ray.get(maker.weights_fingerprint.remote()) == (version0, print0)
    assert ray.get(maker.weights_end.remote(3)) is True
    assert ray.get(maker.weights_fingerprint.remote()) == (3, fingerprint(newer))

    # Two relays run out of order: push 5's chunk_start, then push 4's (late) -> push 5 still
    # loads, and push 4, arriving whole after it, does not take the maker back.
    late, latest = put_buckets(perturbed_state(cfg, seed=6)), put_buckets(perturbed_state(cfg, seed=7))
    ray.get(maker.weights_start.remote(PushHeader(5, len(latest), 0, kl_coef=0.05)))
    ray.get(maker.weights_start.remote(PushHeader(4, len(late), 0, kl_coef=0.05)))
    for i, ref in enumerate(latest):
        ray.get(maker.weights_chunk.remote(5, i, [ref]))
    assert ray.get(maker.weights_end.remote(5)) is True
    fingerprint5 = ray.get(maker.weights_fingerprint.remote())
    assert fingerprint5[0] == 5
    ray.get(maker.weights_start.remote(PushHeader(4, len(late), 0, kl_coef=0.05)))
    for i, ref in enumerate(late):
        ray.get(maker.weights_chunk.remote(4, i, [ref]))
    assert ray.get(maker.weights_end.remote(4)) is False
    assert ray.get(maker.weights_fingerprint.remote()) == fingerprint5


def test_coordinator_relays_pushes_as_refs(ray_session, cfg, actors):
    coordinator, maker = start(cfg, actors)
    state = perturbed_state(cfg, seed=3)
    refs = put_buckets(state)
    ray.get(coordinator.publish_weights.remote(PushHeader(1, len(refs), 0, kl_coef=0.05), refs))
    versions = ray.get(coordinator.wait_for_version.remote(1, 30))
    assert versions == {0: 1}
    assert ray.get(coordinator.maker_fingerprints.remote()) == {0: (1, fingerprint(state))}


def test_streamed_push_interrupted_midway_keeps_the_previous_weights(ray_session, cfg, actors):
    """Rank 0 hands buckets in one by one (``WeightPublisher.publish``) and dies before the last:
    the maker staged the others but never swaps them in; the next push (tied ``lm_head`` left
    out, as the trainer sends it) loads exactly, re-tied."""
    coordinator, maker = start(cfg, actors)
    before = ray.get(maker.weights_fingerprint.remote())
    state = perturbed_state(cfg, seed=4)
    refs = put_buckets(state)
    ray.get(coordinator.publish_start.remote(PushHeader(1, len(refs), 0, kl_coef=0.05)))
    ray.get([coordinator.publish_chunk.remote(1, i, [ref]) for i, ref in enumerate(refs[:-1])])
    assert ray.get(coordinator.wait_for_version.remote(1, 2)) == {0: 0}
    assert ray.get(maker.weights_fingerprint.remote()) == before

    newer = perturbed_state(cfg, seed=5)
    aliases = {"actor.lm_head.weight"}
    newer_refs = put_buckets({k: v for k, v in newer.items() if k not in aliases})
    ray.get(coordinator.publish_start.remote(PushHeader(2, len(newer_refs), 0, kl_coef=0.05)))
    ray.get([coordinator.publish_chunk.remote(2, i, [ref]) for i, ref in enumerate(newer_refs)])
    assert ray.get(coordinator.wait_for_version.remote(2, 30)) == {0: 2}
    assert ray.get(coordinator.maker_fingerprints.remote()) == {0: (2, fingerprint(newer))}


def test_slow_trainer_makes_makers_wait_and_loses_nothing(ray_session, cfg, actors):
    prompts = ray.data.from_items([{"prompt": "1 2 3"}] * 64)
    coordinator, maker = start(cfg, actors, buffer_size=8, prompts=prompts)
    loops = [maker.run.remote(), maker.send_loop.remote()]
    deadline = time.monotonic() + 120  # the "trainer" pulls nothing: the buffer fills, then the maker blocks
    while ray.get(coordinator.status.remote()).buffered != (8,) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(3)  # let the maker run into the full buffer
    status = ray.get(coordinator.status.remote())
    assert status.buffered == (8,)
    # Blocked: at most one send waiting in the coordinator and SEND_QUEUE_BATCHES queued in the maker.
    assert status.counters.produced <= 8 + 2 * cfg.maker.batch_size
    first = ray.get(coordinator.status.remote()).counters.produced
    time.sleep(2)
    assert ray.get(coordinator.status.remote()).counters.produced == first  # still waiting

    pulled = []
    for _ in range(4):
        request = PullRequest(rank=0, n=8, trainer_version=0, timeout_s=30)
        pulled += resolve(ray.get(coordinator.pull.remote(request)).chunks, fetch_objects).items
    final = ray.get(coordinator.finish.remote())
    summaries = ray.get(loops, timeout=30)
    counters = ray.get(coordinator.status.remote()).counters
    assert len(pulled) == 32 == counters.consumed
    assert len({item.uid for item in pulled}) == 32  # no duplicates
    assert counters.produced == (counters.consumed + counters.in_flight + counters.discarded
                                    + counters.lost_in_transit)
    assert counters.discarded == 0
    assert summaries[0]["made"] == counters.produced
    assert final.makers[0].idle_s > 1.0  # back-pressure time is reported as maker idle time


FIRST_BATCH_S = 6.0
SlowFirstBatch = functools.partial(WaitingExperienceMaker, waits=(FIRST_BATCH_S, 0.0), response_len=4)


def test_a_maker_asks_for_its_next_prompts_while_it_makes_a_batch(ray_session, cfg, actors):
    """The round trip for the next prompt batch passes while the current one is made: a maker
    that made its batches one ask at a time idled for it between every two batches."""
    prompts = ray.data.from_items([{"prompt": "1 2 3"}] * 64)
    coordinator, maker = start(cfg, actors, prompts=prompts, maker_factory=SlowFirstBatch)
    loops = [maker.run.remote(), maker.send_loop.remote()]
    served, deadline = 0, time.monotonic() + FIRST_BATCH_S - 1
    while served < 2 * cfg.maker.batch_size and time.monotonic() < deadline:
        time.sleep(0.2)
        counters = ray.get(coordinator.status.remote()).counters
        served = counters.prompts_served
    assert counters.produced == 0  # the first batch is still being made ...
    assert served == 2 * cfg.maker.batch_size  # ... and the second was handed out meanwhile
    deadline = time.monotonic() + 60
    while counters.produced < 2 * cfg.maker.batch_size and time.monotonic() < deadline:
        time.sleep(0.2)
        counters = ray.get(coordinator.status.remote()).counters
    assert counters.produced >= 2 * cfg.maker.batch_size  # the batch asked for ahead was made and sent
    ray.get(coordinator.finish.remote())
    summaries = ray.get(loops, timeout=60)
    assert summaries[0]["made"] == ray.get(coordinator.status.remote()).counters.produced


@ray.remote(num_cpus=0)
def _later(value, delay_s: float):
    time.sleep(delay_s)
    return value


class ScriptedPrompts:
    """A coordinator stand-in for ``MakerWorker.run``: ``next_prompts`` serves the given batches in
    order (a batch with a delay arrives that much after it is asked for), then None."""

    def __init__(self, batches: list[tuple[PromptBatch, float]]):
        self.batches = list(batches)
        self.next_prompts, self.maker_failed = self, None

    def remote(self, maker_id: int):
        batch, delay_s = self.batches.pop(0) if self.batches else (None, 0.0)
        return _later.remote(batch, delay_s) if delay_s else ray.put(batch)


class RecordingQueue(queue.Queue):
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def put(self, entry, *args, **kwargs):
        self.events.append(("queued", None if entry is None else entry[1].prompt_ids[0]))
        super().put(entry, *args, **kwargs)


def test_a_made_batch_goes_to_the_sender_after_the_next_is_encoded_unless_its_prompts_are_late(ray_session, cfg):
    """The sender packs a made batch while the next one generates, not between the two (where the
    maker's thread and the sender's would take turns on the GIL); but a maker whose next prompts
    are not there yet hands its batch over first: admission may be waiting for those very items."""
    worker = MakerWorker(0, cfg.to_dict(), None, functools.partial(WaitingExperienceMaker, response_len=4))
    events = []
    encode = worker.encoder.encode
    worker.encoder.encode = lambda texts: events.append(("encoded", int(texts[0].split()[0]))) or encode(texts)
    worker.outbox = RecordingQueue(events)
    worker.coordinator = ScriptedPrompts([(PromptBatch(["0 1", "0 2"], [0, 1]), 0.0),
                                          (PromptBatch(["2 1", "2 2"], [2, 3]), 0.0),
                                          (PromptBatch(["4 1", "4 2"], [4, 5]), 1.0)])  # late
    assert worker.run() == {"made": 6, "version": 0}
    assert events == [("encoded", 0), ("encoded", 2), ("queued", 0),  # 0 handed over after 2 is encoded
                      ("queued", 2), ("encoded", 4),  # 4's prompts were late: 2 handed over first
                      ("queued", 4), ("queued", None)]


@ray.remote(num_cpus=0)
class Sender:
    """Sends batches the way ``MakerWorker.send_loop`` does: put once, send the chunk."""

    def send(self, coordinator, items) -> int:
        return ray.get(coordinator.send.remote(0, ExperienceChunk.of(items, "ref", put=put_object), MakerStats()))


def test_a_maker_killed_after_sending_costs_no_hang_and_no_miscount(ray_session, actors):
    """A batch lives in the object store of the maker that put it. After that maker is killed
    the batch is either still readable (the node's store had not dropped it yet) or gone; the
    rank gets exactly the items it asked for either way, and every item is accounted for (gone
    ones as ``lost_in_transit``, replaced by the next ones; ``tests/cluster`` loses a node and
    sees them counted). The coordinator never deserialized a batch."""
    coordinator = ray.remote(num_cpus=0)(Coordinator).remote(coordinator_config(items_per_version=10_000))
    doomed, alive = Sender.remote(), Sender.remote()
    actors += [coordinator, alive]
    doomed_items = [_item(f"d-{i}") for i in range(4)]
    assert ray.get(doomed.send.remote(coordinator, doomed_items)) == 4
    ray.kill(doomed)
    made = [_item(f"a-{i}") for i in range(4)]
    assert ray.get(alive.send.remote(coordinator, made)) == 4

    got, batch = _pull(coordinator, rank=0, n=4, version=0, timeout_s=30, step=1)
    assert batch is None  # no pull was sent ahead: the caller merges the items
    counters = ray.get(coordinator.status.remote()).counters
    expected = made if counters.lost_in_transit else doomed_items
    assert [it.uid for it in got] == [it.uid for it in expected]
    assert all(torch.equal(a.values, b.values) for a, b in zip(got, expected))
    assert counters.lost_in_transit in (0, 4)
    assert (counters.produced, counters.consumed) == (8, 4)
    assert counters.in_flight == 4 - counters.lost_in_transit


def _item(uid: str):
    from ray_ppo.algo import ExperienceItem

    n = 2 + int(uid.split("-")[1])  # items of different lengths
    return ExperienceItem.filled(torch.arange(3), torch.arange(n), lambda name: torch.randn(n), reward=0.5,
                                 policy_version=0, uid=uid)


@pytest.mark.parametrize("share", [True, False])
def test_zero_copy_weights_are_the_object_stores_buffers_and_never_recycled(ray_session, cfg, share):
    """``sync.zero_copy`` (``WeightReceiver(share=True)``, what a CPU maker runs): after a push
    every weight of the model lies in the object store's buffers (the same memory a ``ray.get``
    of the buckets maps in this process: one copy for every reader on the node), the swap is
    exact and tied weights re-tied; the next push hands no shared buffer out as staging memory
    (writing into it would change the weights of every maker on the node). Without it the
    weights are copies of the maker's own."""
    from ray_ppo.cluster.handles import fetch_objects
    from ray_ppo.makers.receiver import WeightReceiver
    from ray_ppo.models.sync import assign_state, join_state, split_state

    actor = load_actor(cfg.model.pretrained)
    receiver = WeightReceiver(fetch_objects, share=share)
    for version, seed in [(1, 11), (2, 12)]:
        state = perturbed_state(cfg, seed)
        pushed = {k: v for k, v in state.items() if k.startswith("actor.") and k != "actor.lm_head.weight"}
        refs = put_buckets(pushed)
        assert receiver.start(PushHeader(version, len(refs), 0, kl_coef=0.0), join_state(actor.state_dict(), {}))
        for i, ref in enumerate(refs):
            receiver.chunk(version, i, [ref])
        _, staged = receiver.end(version)
        if version == 2:  # the spares the first swap left: never a pushed buffer
            assert not share or not receiver.spares
        assign_state(actor, split_state(staged.tensors)[0])
        receiver.recycle(staged)
        buffers = [(a.ctypes.data, a.ctypes.data + a.nbytes) for ref in refs for a in ray.get(ref)[1] if a.nbytes]
        in_store = [any(lo <= p.data_ptr() < hi for lo, hi in buffers) for p in actor.parameters()]
        assert all(in_store) if share else not any(in_store)
        assert actor.lm_head.weight is actor.transformer.wte.weight
        assert fingerprint(actor.state_dict()) == fingerprint(split_state(state)[0])
