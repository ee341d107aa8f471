"""Unit tests of ray_ppo.models.sync: byte buckets of a state dict, and weight fingerprints."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from ray_ppo.models.sync import TensorMeta, bucket_nbytes, fingerprint, make_buckets, unpack_bucket

MIB = 2**20


def mb(n_bytes: int) -> float:
    """``bucket_mb`` for a bucket of exactly ``n_bytes`` bytes."""
    return n_bytes / MIB


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(5, 4, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "f16_odd": torch.randn(7, 3, generator=g).to(torch.float16),
        "i64": torch.arange(-6, 5, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "big": torch.randn(300, generator=g),
    }


def round_trip(state, bucket_mb):
    buckets = list(make_buckets(state, bucket_mb))
    rebuilt = {}
    for bucket in buckets:
        part = unpack_bucket(bucket)
        assert not rebuilt.keys() & part.keys()
        rebuilt.update(part)
    return buckets, rebuilt


@pytest.mark.parametrize("bucket_bytes", [64, 200, 1000, 64 * MIB])
def test_round_trip_is_exact(bucket_bytes):
    state = mixed_state()
    buckets, rebuilt = round_trip(state, mb(bucket_bytes))
    assert list(rebuilt) == list(state)
    for name, tensor in state.items():
        assert rebuilt[name].dtype == tensor.dtype, name
        assert rebuilt[name].shape == tensor.shape, name
        assert torch.equal(rebuilt[name], tensor), name
    assert fingerprint(rebuilt) == fingerprint(state)
    if bucket_bytes == 64 * MIB:
        assert len(buckets) == 1
    if bucket_bytes == 64:
        # f32 80 B, bf16 66, f16_odd 42, i64 88, empty 0, scalar 4, big 1200: every tensor alone,
        # except the 0-byte one, which opens a bucket that "scalar" then joins
        assert [[m.name for m in metas] for metas, _ in buckets] == [
            ["f32"], ["bf16"], ["f16_odd"], ["i64"], ["empty", "scalar"], ["big"]]


@pytest.mark.parametrize("state", [
    {"empty": torch.empty(0, 3)},
    {"big": torch.ones(100), "empty": torch.empty(0)},  # the plan opens a new bucket after an oversized tensor
], ids=["only-empty", "empty-after-oversized"])
def test_round_trip_of_a_bucket_with_only_empty_tensors(state):
    buckets, rebuilt = round_trip(state, mb(256))
    assert [bucket_nbytes(b) for b in buckets][-1] == 0
    assert rebuilt["empty"].shape == state["empty"].shape
    assert rebuilt["empty"].dtype == torch.float32


def test_bf16_stays_bf16_bit_for_bit():
    values = torch.tensor([1.0, -0.0, 3.140625, 1e-30, float("inf"), float("nan")], dtype=torch.bfloat16)
    _, rebuilt = round_trip({"w": values}, mb(64))
    assert rebuilt["w"].dtype == torch.bfloat16
    assert torch.equal(rebuilt["w"].view(torch.int16), values.view(torch.int16))


def test_buckets_view_the_tensors_instead_of_copying_them():
    state = mixed_state()
    for metas, arrays in make_buckets(state, mb(1000)):
        for meta, array in zip(metas, arrays):
            assert array.dtype == np.uint8 and array.ndim == 1 and array.nbytes == meta.nbytes
            if meta.nbytes:
                assert array.ctypes.data == state[meta.name].data_ptr(), meta.name  # ray.put makes the one copy


def test_a_non_contiguous_tensor_is_copied_contiguous():
    state = {"t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t()}
    _, rebuilt = round_trip(state, mb(1024))
    assert torch.equal(rebuilt["t"], state["t"])


def test_hand_computed_plan():
    state = {
        "a": torch.zeros(10),                         # 40 B
        "b": torch.zeros(20),                         # 80 B
        "c": torch.zeros(30, dtype=torch.bfloat16),   # 60 B
        "d": torch.zeros(8, dtype=torch.int64),       # 64 B
        "e": torch.zeros(7, 3, dtype=torch.float16),  # 42 B
    }
    # 124-byte buckets: a + b = 120 fits; c would make 180, so c starts the next; c + d = 124 fits; e does not
    buckets = list(make_buckets(state, mb(124)))
    assert [[m.name for m in metas] for metas, _ in buckets] == [["a", "b"], ["c", "d"], ["e"]]
    assert [bucket_nbytes(b) for b in buckets] == [120, 124, 42]
    assert buckets[2][0][0] == TensorMeta("e", "float16", (7, 3), 42)
    # one byte less: d no longer fits beside c, and e (42) now fits beside d (64)
    assert [[m.name for m in metas] for metas, _ in make_buckets(state, mb(123))] == [["a", "b"], ["c"], ["d", "e"]]


def test_a_tensor_bigger_than_a_bucket_gets_a_bucket_of_its_own():
    state = {"small1": torch.ones(4), "big": torch.ones(100), "small2": torch.ones(4)}  # 16, 400, 16 B
    buckets = list(make_buckets(state, mb(256)))
    assert [[m.name for m in metas] for metas, _ in buckets] == [["small1"], ["big"], ["small2"]]
    assert bucket_nbytes(buckets[1]) == 400 > 256


def test_unpack_reads_read_only_arrays_without_copy_or_warning():
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    (metas, arrays), = make_buckets(state, mb(1024))
    arrays = [a.copy() for a in arrays]  # as Ray hands them out: read-only buffers of their own
    for a in arrays:
        a.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = unpack_bucket((metas, arrays))
    assert torch.equal(out["w"], state["w"])
    assert out["w"].data_ptr() == arrays[0].ctypes.data  # a view of the array, not a copy


def test_round_trip_of_the_tiny_model(tiny_path):
    from ray_ppo.models import load_actor

    state = load_actor(tiny_path).state_dict()
    buckets, rebuilt = round_trip(state, 0.05)
    assert len(buckets) > 1
    assert fingerprint(rebuilt) == fingerprint(state)


def test_fingerprint_is_equal_iff_bit_identical():
    state = mixed_state()
    reference = fingerprint(state)
    assert fingerprint({k: v.clone() for k, v in reversed(state.items())}) == reference  # order does not matter

    one_element = dict(state, f32=state["f32"].clone())
    one_element["f32"][4, 3] += 1e-6
    assert fingerprint(one_element) != reference

    other_dtype = dict(state, i64=state["i64"].to(torch.int32))  # same values, other dtype
    assert fingerprint(other_dtype) != reference

    other_shape = dict(state, f32=state["f32"].reshape(4, 5))  # same bytes, other shape
    assert fingerprint(other_shape) != reference

    renamed = {("F32" if k == "f32" else k): v for k, v in state.items()}
    assert fingerprint(renamed) != reference

    # 0.0 == -0.0 as numbers, but the bits differ
    assert fingerprint({"z": torch.tensor([0.0])}) != fingerprint({"z": torch.tensor([-0.0])})


def test_tied_aliases_of_gpt2_are_sent_once(tiny_path):
    from ray_ppo.models import load_actor
    from ray_ppo.models.sync import tied_aliases

    actor = load_actor(tiny_path)
    assert tied_aliases(actor) == {"lm_head.weight"}
    # loading a push without the alias re-ties it: the maker ends up bit-identical
    donor = load_actor(tiny_path)
    with torch.no_grad():
        donor.transformer.wte.weight.add_(1.0)
    pushed = {k: v for k, v in donor.state_dict().items() if k != "lm_head.weight"}
    actor.load_state_dict(pushed, strict=False)
    assert torch.equal(actor.lm_head.weight, donor.lm_head.weight)
    assert fingerprint(actor.state_dict()) == fingerprint(donor.state_dict())


def test_staging_copies_each_tensor_into_its_targets_dtype_and_device():
    from ray_ppo.models.sync import StagedPush

    source = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    view = torch.from_numpy(source.numpy().copy())  # stands in for a read-only object-store view
    targets = {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "other_shape": torch.zeros(4)}
    staged = StagedPush(1, 1, targets)
    staged.stage({"w": view, "other_shape": view, "unknown": view})
    assert staged.tensors["w"].dtype == torch.bfloat16
    assert staged.tensors["w"].data_ptr() not in (view.data_ptr(), targets["w"].data_ptr())  # a fresh copy
    assert torch.equal(staged.tensors["w"], source.to(torch.bfloat16))
    # no matching target: left as it came, for the receiver's key and shape checks to refuse
    assert staged.tensors["other_shape"] is view and staged.tensors["unknown"] is view


def test_shared_staging_keeps_matching_views_and_copies_only_what_needs_converting():
    """``share`` (sync.zero_copy): a tensor whose target has its dtype and device is staged as the
    pushed view itself (no copy); one that must change dtype is copied, into a spare if one fits."""
    from ray_ppo.models.sync import StagedPush

    view = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    spare = torch.empty(2, 3, dtype=torch.bfloat16)
    targets = {"same": torch.zeros(2, 3), "bf16": torch.zeros(2, 3, dtype=torch.bfloat16)}
    staged = StagedPush(1, 1, targets, spares={"same": torch.empty(2, 3), "bf16": spare}, share=True)
    staged.stage({"same": view, "bf16": view})
    assert staged.tensors["same"] is view and staged.shared == {"same"}
    assert staged.tensors["bf16"].data_ptr() == spare.data_ptr()
    assert torch.equal(staged.tensors["bf16"], view.to(torch.bfloat16))
    assert "same" in staged.spares  # not consumed: sharing needs no staging memory


def test_assign_state_swaps_staged_tensors_in_without_copy_and_reties(tiny_path):
    from ray_ppo.models import load_actor
    from ray_ppo.models.sync import StagedPush, assign_state, tied_groups

    actor, donor = load_actor(tiny_path), load_actor(tiny_path)
    assert tied_groups(actor) == [["transformer.wte.weight", "lm_head.weight"]]
    with torch.no_grad():
        for p in donor.parameters():
            p.add_(0.1 * torch.randn_like(p))
    pushed = {k: v for k, v in donor.state_dict().items() if k != "lm_head.weight"}  # aliases are not sent
    staged = StagedPush(1, 1, actor.state_dict())
    staged.stage(pushed)
    assign_state(actor, staged.tensors)
    wte = actor.transformer.wte.weight
    assert isinstance(wte, torch.nn.Parameter) and wte.data_ptr() == staged.tensors["transformer.wte.weight"].data_ptr()
    assert actor.lm_head.weight is wte  # re-tied to the swapped-in tensor
    assert fingerprint(actor.state_dict()) == fingerprint(donor.state_dict())
    x = torch.tensor([[3, 4, 5]])
    torch.testing.assert_close(actor(x).logits, donor(x).logits, rtol=0, atol=0)


def test_assign_state_keeps_the_models_dtype():
    from ray_ppo.models.sync import assign_state

    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assign_state(model, {"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    assert model.weight.dtype == model.bias.dtype == torch.bfloat16
    assert model.weight.requires_grad


def test_a_prepared_swap_binds_nothing_until_applied_and_then_matches_load_state_dict(tiny_path):
    """The maker prepares a swap while it generates and applies it under the model lock: the
    model must be untouched until ``apply``, and then as ``load_state_dict(assign=True)`` with
    re-tying leaves it (same tensors, ``Parameter`` types and ``requires_grad``)."""
    from ray_ppo.models import load_actor
    from ray_ppo.models.sync import prepare_swap, tied_groups

    actor, donor, reference = load_actor(tiny_path), load_actor(tiny_path), load_actor(tiny_path)
    with torch.no_grad():
        for p in donor.parameters():
            p.add_(0.1 * torch.randn_like(p))
    actor.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter stays frozen
    reference.transformer.wpe.weight.requires_grad_(False)
    pushed = {k: v.clone() for k, v in donor.state_dict().items() if k != "lm_head.weight"}
    before = fingerprint(actor.state_dict())
    swap = prepare_swap(actor, pushed)
    assert swap.load is None  # plain rebinding: GPT-2 has no load hooks
    assert fingerprint(actor.state_dict()) == before
    swap.apply()
    (canonical, alias), = tied_groups(reference)
    reference.load_state_dict(pushed, strict=False, assign=True)
    reference.lm_head.weight = reference.get_parameter(canonical)
    got, want = actor.state_dict(keep_vars=True), reference.state_dict(keep_vars=True)
    assert got.keys() == want.keys()
    for name in got:
        assert type(got[name]) is type(want[name]) and got[name].requires_grad == want[name].requires_grad, name
        assert got[name].data_ptr() == want[name].data_ptr() == pushed["transformer.wte.weight" if name == alias
                                                                        else name].data_ptr(), name
    assert actor.lm_head.weight is actor.transformer.wte.weight
    assert not actor.transformer.wpe.weight.requires_grad


def test_a_push_of_another_shape_is_refused_before_any_tensor_is_bound(tiny_path):
    from ray_ppo.models import load_actor
    from ray_ppo.models.sync import prepare_swap

    actor = load_actor(tiny_path)
    pushed = {k: v.clone() + 1 for k, v in actor.state_dict().items() if k != "lm_head.weight"}
    last = list(pushed)[-1]
    pushed[last] = torch.zeros(3, *pushed[last].shape)
    before = fingerprint(actor.state_dict())
    with pytest.raises(ValueError, match=rf"pushed {last} has shape \(3, .*the push is not of this model"):
        prepare_swap(actor, pushed)
    assert fingerprint(actor.state_dict()) == before


def test_a_model_that_loads_its_own_way_is_swapped_through_load_state_dict():
    """BatchNorm overrides ``_load_from_state_dict``: such a model keeps going through it."""
    from ray_ppo.models.sync import prepare_swap

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    pushed = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    swap = prepare_swap(model, pushed)
    assert swap.load is not None and model[0].weight.data_ptr() != pushed["0.weight"].data_ptr()
    swap.apply()
    state = model.state_dict(keep_vars=True)
    assert all(state[k].data_ptr() == pushed[k].data_ptr() for k in pushed)
    assert isinstance(model[1].weight, torch.nn.Parameter) and int(model[1].num_batches_tracked) == 1


def test_staging_reuses_matching_spares_and_a_swap_frees_only_untied_replaced_tensors(tiny_path):
    from ray_ppo.models import load_actor
    from ray_ppo.models.sync import StagedPush, assign_state, replaced_tensors

    actor, donor = load_actor(tiny_path), load_actor(tiny_path)
    pushed = {k: v for k, v in donor.state_dict().items() if k != "lm_head.weight"}
    before = actor.state_dict()
    staged = StagedPush(1, 1, before)
    staged.stage(pushed)
    assign_state(actor, staged.tensors)
    spares = replaced_tensors(before, staged.tensors)
    assert "transformer.wte.weight" not in spares  # tied to lm_head: two names, one buffer, never handed out
    assert set(spares) == set(pushed) - {"transformer.wte.weight"}
    live = {t.data_ptr() for t in actor.state_dict().values()}
    assert not live & {t.data_ptr() for t in spares.values()}  # no model uses them any more

    second = StagedPush(2, 1, actor.state_dict(), spares=dict(spares))
    second.stage(pushed)
    name = "transformer.h.0.attn.c_attn.weight"
    assert second.tensors[name].data_ptr() == spares[name].data_ptr()  # copied into the spare, not a fresh tensor
    assign_state(actor, second.tensors)
    assert fingerprint(actor.state_dict()) == fingerprint(donor.state_dict())
