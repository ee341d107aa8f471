"""Unit tests for ray_ppo.algo.experience: padding layout and exact split/merge round trips."""

import dataclasses
import pickle

import pytest
import torch

from ray_ppo.algo import PER_TOKEN_FIELDS, ExperienceBatch, ExperienceItem, PackedItems
from ray_ppo.algo.experience import unpack


def make_item(prompt, response, reward=0.0, version=0, uid="", seed=0) -> ExperienceItem:
    g = torch.Generator().manual_seed(seed)
    R = len(response)
    return ExperienceItem(
        prompt_ids=torch.tensor(prompt, dtype=torch.long),
        response_ids=torch.tensor(response, dtype=torch.long),
        **{name: torch.randn(R, generator=g) for name in PER_TOKEN_FIELDS},
        reward=reward,
        policy_version=version,
        uid=uid,
    )


def assert_items_equal(actual: ExperienceItem, expected: ExperienceItem):
    for field in dataclasses.fields(ExperienceItem):
        a, e = getattr(actual, field.name), getattr(expected, field.name)
        if isinstance(e, torch.Tensor):
            assert a.dtype == e.dtype and torch.equal(a, e), field.name
        else:
            assert a == e, field.name


@pytest.fixture
def items():
    # (prompt, response) lengths (2, 3), (3, 1), (1, 2): P = 3, R = 3
    return [
        make_item([11, 12], [21, 22, 23], reward=1.0, version=4, uid="m-0-0", seed=0),
        make_item([13, 14, 15], [24], reward=-0.5, version=5, uid="m-0-1", seed=1),
        make_item([16], [25, 26], reward=0.25, version=5, uid="m-0-2", seed=2),
    ]


def test_item_response_length(items):
    assert items[0].response_length == 3


def test_merge_pads_prompts_left_and_responses_right(items):
    batch = ExperienceBatch.merge(items, pad_token_id=0)
    assert (batch.batch_size, batch.prompt_len, batch.num_actions) == (3, 3, 3)
    expected_sequences = torch.tensor(
        [
            [0, 11, 12, 21, 22, 23],
            [13, 14, 15, 24, 0, 0],
            [0, 0, 16, 25, 26, 0],
        ]
    )
    assert torch.equal(batch.sequences, expected_sequences)
    expected_attention = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]])
    assert torch.equal(batch.attention_mask, expected_attention)
    assert batch.action_mask.dtype == torch.bool
    assert torch.equal(batch.action_mask, expected_attention[:, 3:].bool())
    # per-token fields: values at the start of the row, zeros after
    assert torch.equal(batch.values[1], torch.cat([items[1].values, torch.zeros(2)]))
    assert torch.equal(batch.reward, torch.tensor([1.0, -0.5, 0.25]))
    assert torch.equal(batch.policy_version, torch.tensor([4, 5, 5]))
    assert batch.uids == ["m-0-0", "m-0-1", "m-0-2"]


def test_position_ids_ignore_left_padding(items):
    batch = ExperienceBatch.merge(items, pad_token_id=0)
    # cumsum(attention_mask) - 1, clamped at 0:
    # row 0: cumsum (0,1,2,3,4,5) -> (0,0,1,2,3,4); row 1: (1,2,3,4,4,4) -> (0,1,2,3,3,3)
    # row 2: cumsum (0,0,1,2,3,3) -> (0,0,0,1,2,2)
    expected = torch.tensor([[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 2]])
    assert torch.equal(batch.position_ids(), expected)
    # each response's first token (column P) sits at position = its own prompt length
    assert batch.position_ids()[:, 3].tolist() == [2, 3, 1]


def test_split_merge_round_trip_mixed_lengths(items):
    for actual, expected in zip(ExperienceBatch.merge(items, pad_token_id=0).split(), items, strict=True):
        assert_items_equal(actual, expected)


def test_round_trip_when_pad_token_is_a_real_token():
    # EOS == pad is common: real tokens equal to pad_token_id must survive (split reads the masks)
    items = [make_item([0, 7], [8, 0], seed=3), make_item([9, 0, 0], [0], seed=4)]
    for actual, expected in zip(ExperienceBatch.merge(items, pad_token_id=0).split(), items, strict=True):
        assert_items_equal(actual, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_random_lengths(seed):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(8):
        P, R = (int(n) for n in torch.randint(1, 12, (2,), generator=g))
        items.append(
            make_item(
                torch.randint(1, 100, (P,), generator=g).tolist(),
                torch.randint(1, 100, (R,), generator=g).tolist(),
                reward=float(torch.randn(1, generator=g)),
                version=i,
                uid=f"m-{seed}-{i}",
                seed=seed * 100 + i,
            )
        )
    batch = ExperienceBatch.merge(items, pad_token_id=0)
    assert batch.sequences.shape == (8, max(len(x.prompt_ids) for x in items) + max(x.response_length for x in items))
    for actual, expected in zip(batch.split(), items, strict=True):
        assert_items_equal(actual, expected)


def test_select_keeps_padding_width_and_rows(items):
    batch = ExperienceBatch.merge(items, pad_token_id=0)
    sub = batch.select([2, 0])
    assert sub.uids == ["m-0-2", "m-0-0"]
    assert (sub.batch_size, sub.prompt_len, sub.num_actions) == (2, 3, 3)
    assert torch.equal(sub.sequences, batch.sequences[[2, 0]])
    assert torch.equal(sub.advantages, batch.advantages[[2, 0]])
    assert_items_equal(sub.split()[0], items[2])
    assert_items_equal(sub.split()[1], items[0])
    assert torch.equal(batch.select(torch.tensor([1])).policy_version, torch.tensor([5]))


def test_to_device_copies_every_tensor(items):
    batch = ExperienceBatch.merge(items, pad_token_id=0)
    moved = batch.to("cpu")
    assert moved.pad_token_id == 0 and moved.uids == batch.uids
    for actual, expected in zip(moved.split(), items, strict=True):
        assert_items_equal(actual, expected)


def test_merge_rejects_empty_list():
    with pytest.raises(ValueError, match="empty"):
        ExperienceBatch.merge([], pad_token_id=0)


def test_merge_rejects_zero_length_response(items):
    with pytest.raises(ValueError, match="zero-length response"):
        ExperienceBatch.merge([items[0], make_item([1, 2], [], uid="bad")], pad_token_id=0)


def test_merge_rejects_per_token_field_of_wrong_length(items):
    bad = dataclasses.replace(items[0], values=torch.zeros(2))
    with pytest.raises(ValueError, match="values"):
        ExperienceBatch.merge([bad], pad_token_id=0)


def test_packed_items_round_trip_and_slices(items):
    packed = PackedItems.pack(items)
    assert len(packed) == len(items)
    for got, expected in zip(unpack(packed), items):
        assert_items_equal(got, expected)
    for got, expected in zip(unpack(packed, 1, 3), items[1:3]):  # a slice copies only its own range
        assert_items_equal(got, expected)
    assert unpack(packed, 2, 2) == []


def test_packed_items_survive_pickling_with_read_only_buffers(items):
    packed = pickle.loads(pickle.dumps(PackedItems.pack(items), protocol=5))
    for array in packed.arrays.values():
        array.flags.writeable = False  # as Ray hands out object-store buffers
    unpacked = unpack(packed)
    unpacked[0].values.add_(1.0)  # the items' tensors are writable copies
    assert_items_equal(unpacked[1], items[1])


def test_packed_items_carry_version_runs_where_an_item_has_them(items):
    items[2].version_runs = ((5, 1), (6, 1))
    got = unpack(PackedItems.pack(items))
    assert [it.version_runs for it in got] == [None, None, ((5, 1), (6, 1))]
    assert PackedItems.pack(items[:2]).version_runs is None  # nothing carried when no item has runs


def test_packed_items_of_no_items():
    packed = PackedItems.pack([])
    assert len(packed) == 0 and unpack(packed) == []
